"""How likely drafts are to be accepted: each row's recent evidence (on the device, read with the round's one host
read) blended with the drafter's long-run rate, as expected tokens per round for each length."""

from __future__ import annotations

import torch

PRIOR_WEIGHT = 3.0  # pseudo-rounds of the long-run rate each row starts from: a new row drafts at the drafter's rate
DECAY = 0.7  # each older round's evidence weighs this much less: a row copying a passage accepts in bursts
RATE_SMOOTHING = 0.05  # the long-run rate: the mean of the first drafting rounds, then a moving average this fast
INITIAL_RATE = 0.5  # the long-run rate before any round drafted
MOST_LIKELY = 0.999  # a rate never taken as certain: the expected tokens stay finite


def expected_tokens(alpha: torch.Tensor, k_max: int) -> torch.Tensor:
    """``[B, k_max + 1]``: tokens a row emits in a round that drafts k tokens, when each draft is accepted with
    probability ``alpha[b]`` until the first rejection (the bonus token included): ``(1 - a^(k+1)) / (1 - a)``."""
    a = alpha.double().clamp(0.0, MOST_LIKELY)[:, None]
    k = torch.arange(k_max + 1, device=alpha.device, dtype=torch.float64)[None, :]
    return (1 - a ** (k + 1)) / (1 - a)


class Acceptance:
    """Each row's evidence lives in ``Sequences.evidence`` ``[B, 2]`` (accepted drafts, rounds that stopped short of
    the drafts offered; decayed by ``DECAY`` a round), so it moves with its row; the long-run ``rate`` of all rows is
    here. ``expected`` ``[k + 1]``: the batch's mean expected tokens per row for each length, as of the last round
    read."""

    def __init__(self, initial_rate: float = INITIAL_RATE):
        self.rate = initial_rate
        self.drafting_rounds = 0
        self.expected: list[float] | None = None

    def record(self, seqs, accepted: torch.Tensor, k: int) -> None:
        """After a round that offered k drafts (device only: no host read)."""
        if k:
            seqs.evidence.mul_(DECAY).add_(torch.stack([accepted, accepted < k], 1))

    def estimates(self, seqs, k_max: int) -> torch.Tensor:
        """``[k_max + 1 mean expected tokens per row, accepted drafts, short rounds]`` of the running rows, for the
        round's host read."""
        hits, misses = seqs.evidence[:, 0], seqs.evidence[:, 1]
        alpha = (hits + PRIOR_WEIGHT * self.rate) / (hits + misses + PRIOR_WEIGHT)
        return torch.cat([expected_tokens(alpha, k_max).mean(0), torch.stack([hits.sum(), misses.sum()])])

    def update(self, values: list[float], drafted: bool) -> None:
        """What ``estimates`` read: the expected tokens, and the long-run rate fed by rounds that drafted."""
        *expected, hits, misses = values
        self.expected = expected
        if drafted and hits + misses > 0:
            self.drafting_rounds += 1
            step = max(1 / self.drafting_rounds, RATE_SMOOTHING)
            self.rate += step * ((hits + 1) / (hits + misses + 2) - self.rate)

    def tokens(self, k: int) -> float:
        """Expected tokens per row of a round drafting k (the last estimates, else the long-run rate)."""
        if self.expected is not None and k < len(self.expected):
            return self.expected[k]
        a = min(self.rate, MOST_LIKELY)
        return (1 - a ** (k + 1)) / (1 - a)
