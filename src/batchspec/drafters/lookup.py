"""Prompt lookup (model-free n-gram drafting, as HF's ``prompt_lookup_num_tokens``), batched, with the round's block
width chosen from what each row's match promises and what a wider block costs.

For n from ``max_ngram`` down to ``min_ngram``, find the latest earlier occurrence of each row's last n tokens in
its own prompt + generated tokens; the longest n that occurs is the row's *match length*, and the tokens that
followed that occurrence are its candidate drafts (the latest occurrence: a passage being copied or a phrase being
repeated continues like its most recent use). Rows with no match propose none.

How far a copy goes on being right depends on how long the match is (a 1-token match is a weak hint; an 8-token one
usually means the model is copying a passage): the drafter keeps, per match length and draft index j, how often the
j-th draft was accepted when offered (counts over every round it served, from an optimistic prior), so it knows
P(drafts 1..j all accepted | match length). A round that verifies j drafts per row then yields
``E(j) = rows + sum of those chances`` tokens and costs ``budget.verify[j]`` plain steps (the round's
``DraftBudget``, from the measured cost profile); the round verifies the j with the most tokens per plain step. On a
CPU the first few columns cost little and the later ones much; on a wide batch every column costs much. Without
costs (``speculation="fixed"``) every candidate up to K is verified, the classic behaviour. With sampling every row
proposes up to k, so that a seed's tokens never depend on what ran before. The block is as wide as the longest proposal in the batch (one host read per round), so a round where
nothing was worth drafting costs one plain decoding step.

Where the target's runner packs a verification (only each row's real tokens are computed: the fp32 Llama C layer),
a row drafting little costs little beside one drafting much, so rows are sized one by one (``budget.per_row``):
``budget.verify[m]`` is then a round verifying m drafts in all, and the round verifies the m likeliest drafts of the
whole batch (each row's first ones, at what each row's tokens are worth), the m with the most tokens per plain step.
On a batch whose forward is bound by arithmetic (8 rows on a 2-core CPU), a width shared by every row paid for drafts
of rows that had no good match.
"""

import torch

from ..model.kernels import lookup_match
from .base import Drafter, Proposal

PRIOR_WEIGHT = 5.0


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


def likeliest(chance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a round sized row by row from ``chance`` ``[B, k]`` (P(draft j of row b is accepted), falling with j):
    ``(expected accepted drafts of the m likeliest drafts of the batch, m = 1..B*k; each draft's rank [B, k])``. The
    round verifying m drafts gives row b ``(rank[b] < m).sum()`` of them: its first ones."""
    top = chance.flatten().sort(descending=True, stable=True)
    rank = torch.empty_like(top.indices).scatter_(0, top.indices, torch.arange(chance.numel(), device=chance.device))
    return top.values.cumsum(0), rank.view_as(chance)


class PromptLookup(Drafter):
    name = "prompt-lookup"
    sizes_own_drafts = True  # greedy rounds sized from the budget's verification costs
    packs_rows = True

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.first = prior_rate(max_ngram)  # [max_ngram + 1]: where an untried first copy starts
        self.offered = self.hits = None  # [max_ngram + 1, K]: drafts offered / accepted, per match length and index

    def survival(self, k: int, device) -> torch.Tensor:
        """``[max_ngram + 1, k]``: estimated P(drafts 1..j all accepted | match length n), the product of each
        index's estimated acceptance given the ones before it. Each index's estimate starts from the one before it
        (``PRIOR_WEIGHT`` pseudo-counts; the first from ``prior_rate``): an index rarely offered yet is taken to go
        on like the ones before, so a long match that was always right earns wider blocks before they are tried."""
        self._tables(k, device)
        if self.first.device != self.offered.device:
            self.first = self.first.to(self.offered.device)
        return survival(self.hits[:, :k], self.offered[:, :k], self.first)

    def _tables(self, k: int, device) -> None:
        """``offered`` / ``hits`` with at least k indices, on ``device`` (grown, keeping what was learned)."""
        if self.offered is None:
            self.offered, self.hits = (torch.zeros((self.max_ngram + 1, k), dtype=torch.float64, device=device)
                                       for _ in range(2))
        elif self.offered.shape[1] < k or self.offered.device != device:
            grow = (0, max(k - self.offered.shape[1], 0))
            self.offered, self.hits = (torch.nn.functional.pad(t, grow).to(device) for t in (self.offered, self.hits))

    def propose(self, seqs, state, budget):
        b, dev, k = len(seqs.length), seqs.length.device, budget.k
        drafts, n_drafts, match = self.candidates(seqs, k)
        if budget.sized and not seqs.sampling:  # (under sampling every candidate: a seed's tokens stay put)
            offered = torch.arange(k, device=dev)[None, :] < n_drafts[:, None]
            chance = self.survival(k, dev)[match] * offered  # [B, k]: P(draft j of row b is accepted)
            if budget.per_row:  # each row sized on its own: the batch's m drafts worth most, m = 0..B*k
                gain, rank = likeliest(budget.weigh(chance))
                tokens = torch.cat([chance.new_full((1,), float(b)), b + gain])  # E(m)
                most = min(b * k, len(budget.verify) - 1)  # what the runner packs
                m = (tokens[: most + 1] / budget.verify_tensor(most, dev)).argmax()
                n_drafts = (rank < m).sum(1)  # a row's chances fall with j: its first ones
            else:  # one width for the batch: E(j), j = 0..k, from the expected accepted tokens in each column
                gain = chance.sum(0)
                tokens = torch.cat([gain.new_full((1,), float(b)), b + gain.cumsum(0)])
                n_drafts = torch.minimum(n_drafts, (tokens / budget.verify_tensor(k, dev)).argmax())
        # verify only as many slots as the longest proposal: rows without a match would waste the rest
        w = int(n_drafts.max()) if b else 0
        drafts = torch.where(torch.arange(w, device=dev)[None, :] < n_drafts[:, None], drafts[:, :w], 0)
        return Proposal(drafts, n_drafts, match=match)  # deterministic: q is one-hot on the proposal

    def candidates(self, seqs, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's candidates ``[B, k]`` (entries past its count are 0), their count ``[B]`` (0: no match) and
        the match length ``[B]``."""
        hist, length = seqs.history, seqs.length
        t, dev = hist.shape[1], hist.device
        found = lookup_match(hist, length, self.max_ngram)  # the C scan where it applies: ~0.3 ms a round less
        match, latest = found if found is not None else self._match(hist, length)
        found = match >= self.min_ngram
        match = match.masked_fill(~found, 0)
        start = latest + 1
        n_drafts = torch.where(found, (length - start).clamp(max=k), torch.zeros_like(start))
        col = torch.arange(k, device=dev)[None, :]
        drafts = hist.gather(1, (start[:, None] + col).clamp(max=t - 1))
        return torch.where(col < n_drafts[:, None], drafts, 0), n_drafts, match

    def _match(self, hist: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(match length [B], end of its latest occurrence [B])`` in tensor operations (``kernels.lookup_match``
        in C)."""
        t, dev, n_max = hist.shape[1], hist.device, self.max_ngram
        # every position i as the end of a window of the n_max tokens up to it (left-padded with -1), compared with
        # the row's last n_max tokens (-2 before its start): the run of matches back from i is the match length there
        padded = torch.nn.functional.pad(hist, (n_max - 1, 0), value=-1)
        tail_pos = length[:, None] - n_max + torch.arange(n_max, device=dev)[None, :]
        tail = torch.where(tail_pos >= 0, padded.gather(1, tail_pos + n_max - 1), -2)
        eq = padded.unfold(1, n_max, 1) == tail[:, None, :]  # [B, t, n_max]
        run = eq.flip(-1).cumprod(-1).sum(-1)  # [B, t]
        # the occurrence must end before the last token, so that something follows it
        run = run.masked_fill(torch.arange(t, device=dev)[None, :] >= (length[:, None] - 1), 0)
        match = run.max(1).values
        return match, t - 1 - (run == match[:, None]).flip(1).int().argmax(1)  # the latest occurrence of that length

    def commit(self, state, proposal: Proposal, accepted, target) -> None:
        w = proposal.drafts.shape[1]
        if not w or proposal.match is None:
            return
        self._tables(w, accepted.device)
        j = torch.arange(w, device=accepted.device)[None, :]
        rows = proposal.match[:, None].expand(-1, w)
        cols = j.expand(rows.shape[0], -1)
        # draft j is put to the test only when drafts 1..j-1 were accepted (the survival multiplies these rates)
        offered = (j < proposal.n_drafts[:, None]) & (j <= accepted[:, None])
        self.offered.index_put_((rows, cols), offered.double(), accumulate=True)
        self.hits.index_put_((rows, cols), (j < accepted[:, None]).double(), accumulate=True)
