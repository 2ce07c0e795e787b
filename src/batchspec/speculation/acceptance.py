"""How likely drafts are to be accepted, every estimator the decision uses: each row's recent evidence (on the device,
read with the round's one host read) blended with the drafter's long-run rate, as expected tokens per round for each
length (``Acceptance``); copies per match length and draft index (``Copies``); a head's first drafts (``HeadRate``).
Each starts from one prior weighed ``PRIOR_WEIGHT`` rounds."""

from __future__ import annotations

import torch

# pseudo-rounds (or counts) of the prior each estimate starts from: about what a row's decayed evidence adds up to
# (1 / (1 - DECAY)), so a fresh estimate follows its first few rounds without being thrown by one
PRIOR_WEIGHT = 3.0
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


def prior_rate(max_ngram: int) -> torch.Tensor:
    """``[max_ngram + 1]``: where an untried first copy starts, per match length n: n / (n + 2), the longer the match
    the likelier the copy (0.33 after 1 token, 0.8 after 8; measured on the built-in and Spec-Bench 8 answers: 0.21,
    0.48, 0.66, 0.71, 0.74, 0.73, 0.88, 0.89 for n = 1..8)."""
    n = torch.arange(max_ngram + 1, dtype=torch.float64)
    return n / (n + 2)


def survival(hits: torch.Tensor, offered: torch.Tensor, first) -> torch.Tensor:
    """``[..., k]`` P(drafts 1..j all accepted) from counts ``[..., k]`` of draft j accepted / offered (offered only
    after drafts 1..j-1 were accepted): each index's rate from ``PRIOR_WEIGHT`` pseudo-counts at the rate before it
    (the first at ``first``, a number or one per leading index), the rates multiplied. The rates' recurrence
    ``r_j = a_j + b_j r_(j-1)`` (``a_j = hits_j / (offered_j + W)``, ``b_j = W / (offered_j + W)``) is unrolled with
    running products, ``r_j = B_j (first + sum_(i<=j) a_i / B_i)``, ``B_j = b_1 ... b_j``: a few operations, not a
    few per index (every term is positive: nothing cancels)."""
    weight = offered + PRIOR_WEIGHT
    kept = (PRIOR_WEIGHT / weight).cumprod(-1)  # B_j
    start = torch.zeros_like(offered[..., :1]) + (first[..., None] if torch.is_tensor(first) else first)
    return (kept * (start + (hits / weight / kept).cumsum(-1))).cumprod(-1)


class Copies:
    """How often a copied draft is accepted, per key (the match length that found it) and draft index: ``offered`` /
    ``hits`` ``[keys, K]``, counts over every round that drafted copies (and the first copies a head round scored)."""

    def __init__(self):
        self.offered = self.hits = None
        self.first = None  # [keys]: where an untried first copy starts (``prior_rate``)

    def survival(self, k: int, device, keys: int = 9) -> torch.Tensor:
        """``[keys, k]``: estimated P(drafts 1..j all accepted | match length n), the product of each index's
        estimated acceptance given the ones before it. Each index's estimate starts from the one before it (the first
        from ``prior_rate``): an index rarely offered yet is taken to go on like the ones before, so a long match that
        was always right earns wider blocks before they are tried."""
        self._tables(k, device, keys)
        if self.first.device != self.offered.device:
            self.first = self.first.to(self.offered.device)
        return survival(self.hits[:, :k], self.offered[:, :k], self.first)

    def _tables(self, k: int, device, keys: int = 9) -> None:
        """``offered`` / ``hits`` with at least k indices, on ``device`` (grown, keeping what was learned)."""
        if self.offered is None:
            self.first = prior_rate(keys - 1)
            self.offered, self.hits = (torch.zeros((keys, k), dtype=torch.float64, device=device) for _ in range(2))
        elif self.offered.shape[1] < k or self.offered.device != device:
            grow = (0, max(k - self.offered.shape[1], 0))
            self.offered, self.hits = (torch.nn.functional.pad(t, grow).to(device) for t in (self.offered, self.hits))

    def learn(self, match: torch.Tensor, offered: torch.Tensor, width: int, accepted: torch.Tensor, keys: int) -> None:
        """Row b offered ``offered[b]`` copies of a match of length ``match[b]`` in a block ``width`` wide and
        ``accepted[b]`` of them were accepted (device only: no host read)."""
        if not width:
            return
        self._tables(width, accepted.device, keys)
        j = torch.arange(width, device=accepted.device)[None, :]
        rows = match[:, None].expand(-1, width)
        cols = j.expand(rows.shape[0], -1)
        # draft j is put to the test only when drafts 1..j-1 were accepted (the survival multiplies these rates)
        tried = (j < offered[:, None]) & (j <= accepted[:, None])
        self.offered.index_put_((rows, cols), tried.double(), accumulate=True)
        self.hits.index_put_((rows, cols), (j < accepted[:, None]).double(), accumulate=True)


class HeadRate:
    """How often a head's first draft is accepted: ``table`` ``[2]``, first drafts accepted / scored (every round
    that runs the head scores one a row)."""

    def __init__(self):
        self.table = None

    def survival(self, k: int, device) -> torch.Tensor:
        """``[k]`` P(the head's drafts 1..j all accepted): its first-draft rate (``PRIOR_WEIGHT`` pseudo-rounds at
        ``INITIAL_RATE``) to the power j. Measured per index under training-time test, the later drafts' rates given
        the earlier accepted are about the first's (0.41 / 0.40 / 0.44 / 0.46 on the built-in prompts), and unlike
        them the first is scored in every round that runs the head, so a width seldom drafted is not priced from
        stale evidence."""
        hits, scored = self.counts(device)
        rate = (hits + PRIOR_WEIGHT * INITIAL_RATE) / (scored + PRIOR_WEIGHT)
        return rate ** torch.arange(1, k + 1, device=device, dtype=torch.float64)

    def counts(self, device) -> torch.Tensor:
        """``[2]``: the head's first drafts accepted / scored."""
        if self.table is None or self.table.device != device:
            self.table = torch.zeros(2, dtype=torch.float64, device=device)
        return self.table

    def learn(self, first: torch.Tensor, token: torch.Tensor) -> None:
        """The head's first drafts ``[B]`` against the target's tokens there ``[B]``."""
        table = self.counts(token.device)
        table[0] += (first == token).sum()
        table[1] += len(token)
