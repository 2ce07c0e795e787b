"""How a greedy round of the feature-reading head is planned: which kind of round (copies only, the head, a head
round that first catches up on a long wait, or a plain step) and how wide, from each kind's expected tokens over its
cost in plain steps. The acceptance it plans with is learned here: prompt lookup's per match length and index, and the
head's first drafts (scored in every round that runs the head)."""

from __future__ import annotations

import math

import torch

from ..base import Proposal
from ..lookup import PRIOR_WEIGHT, PromptLookup, likeliest

# rounds that draft copies only (the head does not run) / that run the head / that run it after a long wait
KINDS = ("copy", "head", "catch-up")
HEAD_STEP = 0.1  # a drafting step of the head, in plain steps, for widths not measured yet (measured: 0.08-0.11)
CATCH_UP = 32  # a head round catching up on more pairs than this per row is timed as a catch-up round
# what a catch-up round costs per waiting pair (all rows, holes included: the head's forward covers the rectangle)
# over a head round of its width, in plain steps, until the policy measured it (measured: ~70 us a pair, 0.0039 /
# 0.0028 / 0.0025 plain steps at 1 / 4 / 8 rows, SmolLM2-135M's head on a 2-core CPU)
CATCH_UP_PAIR = 0.003
# a catch-up is paid once for the head rounds it makes possible, so its cost is shared by this many rounds (and by
# no more than the rounds left): priced whole against one round it never wins, the wait grows, and the head never
# runs again
CATCH_UP_SHARED = 8
# a head round drafts on while some row's drafts are at least this likely by the head's own probabilities (their
# product, copies counting 1); None: the planned width, drafted whole (measured: 0.4 gave 1.24x plain at batch 1 on
# the built-in prompts where the planned width gave 1.22x, 0.25 and 0.6 no better; docs/benchmarks.md)
DEPTH_CONFIDENCE = 0.4


class RoundPlanner:
    """The plan of each greedy round of a head drafting with copies (``copy``: its prompt lookup); ``table`` ``[2]``:
    the head's first drafts accepted / scored."""

    def __init__(self, copy: PromptLookup):
        self.copy = copy
        self.table = None

    def plan(self, copies, n_copies, match, k: int, costs, per_token: bool = False, row_value=None,
             catch_up: int = 0, left=None):
        """``(kind, width, rows that copy, drafts per row of a copy round)`` for a greedy round of at most k drafts.
        A row copies first when its match length's first copied draft is accepted more often than the head's first
        draft. Each kind of round and size is worth its expected tokens over its cost (``costs``, in plain steps):
        "copy" rounds verify only the copies (rows without a match draft nothing; the head does not run), "head"
        rounds run the head for j steps (it drafts on after the copies), priced as a "catch-up" round when the head
        has a long wait to catch up on (``catch_up``: the waiting pairs of all rows; ``left``: the most tokens a row
        may still generate, a device scalar, or None for many). Where rows are sized one by one (``per_token``: the
        runner packs verification), a copy round verifies the m likeliest copies of the batch (each row's first
        ones), m = 0..rows x k, priced by the drafts it verifies in all, and a head round of width j is priced as
        rows x j drafts. Without costs (fixed length): a "head" round of k."""
        dev, b = match.device, len(match)
        col = torch.arange(k, device=dev)[None, :]
        copied = self.copy.survival(k, dev)[match] * (col < n_copies[:, None])  # [B, k] P(copies 1..j accepted)
        head = self.head_survival(k, dev)  # [k]
        use = (n_copies > 0) & (copied[:, 0] > head[0])
        if costs is None:
            return "head", k, use, None
        last = copied.gather(1, (n_copies - 1).clamp(min=0)[:, None])
        mixed = torch.where(col < n_copies[:, None], copied, last * head[(col - n_copies[:, None]).clamp(min=0)])
        mixed = torch.where(use[:, None], mixed, head[None, :])
        per = b if per_token else 1  # drafts verified per unit of a head round's width
        if per > 1:  # a copy round's m copies of the batch worth most: E(m), m = 0..b*k
            if row_value is not None:  # each row's expected tokens at its worth
                copied, mixed = copied * row_value[:, None], mixed * row_value[:, None]
            gain, rank = likeliest(copied)
        else:  # one width for the batch: E(j), j = 0..k, from each column's expected accepted drafts
            gain = copied.sum(0).cumsum(0)
        pad = torch.nn.functional.pad
        tokens = b + torch.cat([pad(gain, (1, 0)), pad(mixed.sum(0).cumsum(0), (1, 0))])  # copy m, then head j
        price = self.round_costs(k, dev, costs, catch_up, per, left)  # [copy / head, m = 0..k*per]
        best = (tokens / torch.cat([price[0], price[1, ::per]])).argmax()  # the first of equals: a plain step
        copy_round = best <= k * per
        if per > 1:  # a copy round of m drafts: each row's first ones among the m likeliest
            n = torch.where(copy_round, (rank < best).sum(1), 0)
        else:
            n = torch.where(copy_round, n_copies.clamp(max=best), 0)
        best, width = torch.stack([best, n.max()]).tolist()  # the round's host read
        if best <= k * per:
            return "copy", width, use, n
        return "head", best - k * per - 1, use, None

    def round_costs(self, k: int, device, costs, catch_up: int = 0, per: int = 1, left=None) -> torch.Tensor:
        """``[copy / head, m]``: a round verifying m = 0..k x ``per`` drafts in all, in plain steps (``per``: the rows
        of a round sized row by row, where a head round of width j verifies j x rows; else 1, and m is the width):
        what the policy gives per kind (measured, or its line through that kind's rounds); else, for a copy round
        ``1 + 0.2 m / per``, for a head round the copy round of its size plus ``HEAD_STEP`` per step the head runs;
        never falling with m; sizes past what the policy prices (what the runner packs) ``inf``. After a long wait
        (``catch_up`` pairs waiting, all rows) a head round costs a head round of its size plus each waiting pair's
        cost, as the policy measured it from catch-up rounds (``costs["work"]["catch-up"]``), else
        ``CATCH_UP_PAIR``, shared by ``CATCH_UP_SHARED`` rounds or by the rounds ``left`` if fewer. Priced by pairs,
        not by what a catch-up round of that width cost once (its wait's cost), and shared, not charged to one round:
        priced whole, a catch-up loses to a plain round, the wait grows every round, and the head stays out. A size
        the policy has not let a kind explore yet (``inf``) stays out of reach."""
        n = k * per
        given = {kind: list(costs.get(kind) or [])[: n + 1] for kind in ("copy", "head")}
        priced = [len(v) - 1 for v in given.values() if v]
        most = min(n, *priced) if per > 1 and priced else n  # what the runner packs
        given = {kind: values + [None] * (n + 1 - len(values)) for kind, values in given.items()}
        prior = [1.0 + self.copy.default_cost * m / per if m <= most else math.inf for m in range(n + 1)]
        copy = [c if c is not None else p for c, p in zip(given["copy"], prior)]  # inf: not explored yet
        known = [c if math.isfinite(c) else p for c, p in zip(copy, prior)]
        head = [g if g is not None else c + HEAD_STEP * m / per for m, (g, c) in enumerate(zip(given["head"], known))]
        price = torch.tensor([copy, head], dtype=torch.float64, device=device)
        if catch_up:
            pair = (costs.get("work") or {}).get("catch-up")
            shared = CATCH_UP_SHARED if left is None else left.clamp(1, CATCH_UP_SHARED)  # on the device: no read
            price[1] += (CATCH_UP_PAIR if pair is None else pair) * catch_up / shared
        return price.cummax(1).values

    def head_survival(self, k: int, device) -> torch.Tensor:
        """``[k]`` P(the head's drafts 1..j all accepted): its first-draft rate (``PRIOR_WEIGHT`` pseudo-rounds at
        0.5) to the power j. Measured per index under training-time test, the later drafts' rates given the earlier
        accepted are about the first's (0.41 / 0.40 / 0.44 / 0.46 on the built-in prompts), and unlike them the
        first is scored in every round that runs the head, so a width seldom drafted is not priced from stale
        evidence."""
        hits, scored = self._first_drafts(device)
        rate = (hits + PRIOR_WEIGHT * 0.5) / (scored + PRIOR_WEIGHT)
        return rate ** torch.arange(1, k + 1, device=device, dtype=torch.float64)

    def _first_drafts(self, device) -> torch.Tensor:
        """``[2]``: the head's first drafts accepted / scored."""
        if self.table is None or self.table.device != device:
            self.table = torch.zeros(2, dtype=torch.float64, device=device)
        return self.table

    def learn(self, proposal: Proposal, accepted: torch.Tensor, target) -> None:
        """Acceptance of copies (per match length and index) and of the head's first drafts. Both first drafts are
        scored in every round that runs the head, whichever was drafted (the target's first token is known); the
        copies' later indices where drafted."""
        if proposal.kind == "copy":
            self.copy.commit(None, proposal, accepted, target)
            return
        match, n_copies, copied, head, use = proposal.match.unbind(1)
        token = target.tokens()[:, 0]
        use = use.bool()
        weak = (n_copies > 0) & ~use  # copies not drafted: their first one scored all the same
        offered = torch.where(use, n_copies.clamp(max=proposal.drafts.shape[1]), weak.long())
        right = torch.where(use, torch.minimum(accepted, offered), (weak & (copied == token)).long())
        self.copy.commit(None, Proposal(proposal.drafts, offered, match=match), right, target)
        table = self._first_drafts(token.device)
        table[0] += (head == token).sum()
        table[1] += len(token)
