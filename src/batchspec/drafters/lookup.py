"""Prompt lookup (model-free n-gram drafting, as HF's ``prompt_lookup_num_tokens``), batched, with each row's draft
length chosen from its match.

For n from ``max_ngram`` down to ``min_ngram``, find the earliest earlier occurrence of each row's last n tokens in
its own prompt + generated tokens; the longest n that occurs is the row's *match length*, and the tokens that
followed that occurrence are its candidate drafts. Rows with no match propose none.

How far a copy goes on being right depends on how long the match is (a 1-token match is a weak hint; an 8-token one
usually means the model is copying a passage): the drafter keeps, per match length and draft index j, how often the
j-th draft was accepted when offered (counts over every round it served, from an optimistic prior), so it knows
P(drafts 1..j all accepted | match length). The block's j-th column is verified only if the rows' summed chances
there cover its cost: ``cost_per_token`` x rows, one more verified column's seconds in plain steps, which the
engine's policy measures (``policy.drafter_length``; ``speculation="fixed"`` sets 0: every candidate up to K, the
classic behaviour). With sampling every row proposes up to k, so that a seed's tokens never depend on what ran
before. The block is as wide as the longest proposal in the batch (one host read per round), so a round where
nothing was worth drafting costs one plain decoding step.
"""

import torch

from .base import Drafter, Proposal

PRIOR_HITS, PRIOR_MISSES = 4.0, 1.0  # an untried (match length, index) starts at 0.8: worth trying


class PromptLookup(Drafter):
    name = "prompt-lookup"
    sizes_own_drafts = True  # the engine sets ``cost_per_token`` before each round (``policy.drafter_length``)

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1, default_cost: float = 0.2):
        """``default_cost``: what one more verified token costs, in plain decoding steps, until the engine's policy
        has measured it (``cost_per_token``)."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 0.0 <= default_cost < 1.0:
            raise ValueError(f"default_cost must be in [0, 1), got {default_cost}")
        self.max_ngram, self.min_ngram, self.default_cost = max_ngram, min_ngram, default_cost
        self.cost_per_token: float | None = None
        self.offered = self.hits = None  # [max_ngram + 1, K]: drafts offered / accepted, per match length and index

    def survival(self, k: int, device) -> torch.Tensor:
        """``[max_ngram + 1, k]``: estimated P(drafts 1..j all accepted | match length n), the product of each
        index's estimated acceptance given the ones before it."""
        if self.offered is None:
            self.offered, self.hits = (torch.zeros((self.max_ngram + 1, k), dtype=torch.float64, device=device)
                                       for _ in range(2))
        elif self.offered.shape[1] < k or self.offered.device != device:  # keep what was learned
            grow = (0, max(k - self.offered.shape[1], 0))
            self.offered, self.hits = (torch.nn.functional.pad(t, grow).to(device) for t in (self.offered, self.hits))
        s = (self.hits[:, :k] + PRIOR_HITS) / (self.offered[:, :k] + PRIOR_HITS + PRIOR_MISSES)
        return s.cumprod(1)

    def propose(self, seqs, state, k):
        hist, length = seqs.history, seqs.length
        b, t = hist.shape
        dev = hist.device
        cols = torch.arange(t, device=dev)
        found = torch.zeros(b, dtype=torch.bool, device=dev)
        start = torch.zeros(b, dtype=torch.long, device=dev)
        match = torch.zeros(b, dtype=torch.long, device=dev)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if t <= n:
                continue
            tail_idx = (length[:, None] - n + torch.arange(n, device=dev)[None, :]).clamp(min=0)
            tail = hist.gather(1, tail_idx)  # [B, n]: the last n tokens
            windows = hist.unfold(1, n, 1)  # [B, t-n+1, n]
            hit = (windows == tail[:, None, :]).all(-1)
            # a window must end before the last token, so that something follows it
            hit &= (cols[: t - n + 1][None, :] + n < length[:, None]) & (length[:, None] > n)
            has = hit.any(1)
            take = has & ~found
            start = torch.where(take, hit.int().argmax(1) + n, start)
            match = torch.where(take, n, match)
            found |= has
        n_drafts = torch.where(found, (length - start).clamp(max=k), torch.zeros_like(start))
        cost = self.default_cost if self.cost_per_token is None else self.cost_per_token
        if not seqs.sampling and k and cost > 0:
            # the block's j-th column pays for itself when the rows' expected accepted tokens there cover its cost
            offered = torch.arange(k, device=dev)[None, :] < n_drafts[:, None]
            gain = (self.survival(k, dev)[match] * offered).sum(0)
            n_drafts = torch.minimum(n_drafts, (gain >= cost * b).sum())
        # verify only as many slots as the longest proposal: rows without a match would waste the rest
        w = int(n_drafts.max()) if b else 0
        idx = (start[:, None] + torch.arange(w, device=dev)[None, :]).clamp(max=t - 1)
        drafts = hist.gather(1, idx)
        drafts = torch.where(torch.arange(w, device=dev)[None, :] < n_drafts[:, None], drafts, 0)
        return Proposal(drafts, n_drafts, match=match)  # deterministic: q is one-hot on the proposal

    def commit(self, state, proposal: Proposal, accepted, target) -> None:
        w = proposal.drafts.shape[1]
        if not w or proposal.match is None:
            return
        self.survival(w, accepted.device)  # the tables, grown to w if needed
        j = torch.arange(w, device=accepted.device)[None, :]
        rows = proposal.match[:, None].expand(-1, w)
        cols = j.expand(rows.shape[0], -1)
        self.offered.index_put_((rows, cols), (j < proposal.n_drafts[:, None]).double(), accumulate=True)
        self.hits.index_put_((rows, cols), (j < accepted[:, None]).double(), accumulate=True)
