"""What a token of each row is worth to the batch (``row_values``), where the batch runs until its last row is done."""

from __future__ import annotations

import math

import torch

FIRST_PACE = 0.5  # tokens a round past the first a row is taken to gain while it has run few rounds (``SETTLED``)
SETTLED = 4
NARROWEST = 0.3  # the least spread of the rows' rounds left (Gumbel scale, rounds)


def row_values(seqs, fixed: float) -> torch.Tensor:
    """``[B]`` what a token of each row is worth, in tokens of a row, where the batch runs until its last row is done
    (no request waits to take a finished row's place). A batch's remaining time is about a step's fixed share
    (``fixed``) times the rounds its last row needs plus the rest of a step times every row's rounds: a token saves its
    row one round's share of the rest (``1 - fixed``), and moves the batch's end by what it takes off the most rounds
    left (``end``) times every row's share of the fixed part (``fixed * B``).

    The rounds a row has left (its tokens left at its own pace) are uncertain by how its rounds' tokens vary (a
    geometric count of accepted drafts: variance ``e (1 + e)`` for ``e`` extra tokens a round): the batch's end is
    the expected maximum of the rows' rounds left under Gumbel noise of that spread, ``tau * logsumexp(left / tau)``,
    and a token moves it by the difference one round less makes. Rows well behind the others move it by a round a
    token; rows level with others by little, as all of them would have to gain; a row far ahead not at all. Rows
    with fewer than ``SETTLED`` rounds gain ``FIRST_PACE`` a round as far as the spread goes."""
    done, rounds = seqs.generated().double(), seqs.rounds.double()
    pace = (done / rounds.clamp(min=1)).clamp(min=1.0)  # tokens a round so far
    left = (seqs.limit - done).clamp(min=0) / pace  # rounds left, if no stop token comes first
    extra = torch.where(rounds < SETTLED, FIRST_PACE, pace - 1)
    spread = (left * extra * (1 + extra)).sqrt() / pace
    tau = (spread.max() * math.sqrt(6) / math.pi).clamp(min=NARROWEST)  # the Gumbel scale of that spread
    last = (left / tau).softmax(0)
    end = -tau * torch.log1p(last * torch.expm1(-1 / tau))  # rounds off the expected end, one round less
    return (1 - fixed) + fixed * len(left) * end
