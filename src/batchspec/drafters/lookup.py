"""Prompt lookup (model-free n-gram drafting, as HF's ``prompt_lookup_num_tokens``), batched.

For n from ``max_ngram`` down to ``min_ngram``, find the earliest earlier occurrence of each row's last n tokens in
its own prompt + generated tokens and propose the (up to K) tokens that followed it. Rows with no match propose none.
The block is as wide as the longest proposal in the batch (one host read per round), so a round where nothing matched
costs one plain decoding step.
"""

import torch

from .base import Drafter, Proposal


class PromptLookup(Drafter):
    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs, state, k):
        hist, length = seqs.history, seqs.length
        b, t = hist.shape
        dev = hist.device
        cols = torch.arange(t, device=dev)
        found = torch.zeros(b, dtype=torch.bool, device=dev)
        start = torch.zeros(b, dtype=torch.long, device=dev)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if t <= n:
                continue
            tail_idx = (length[:, None] - n + torch.arange(n, device=dev)[None, :]).clamp(min=0)
            tail = hist.gather(1, tail_idx)  # [B, n]: the last n tokens
            windows = hist.unfold(1, n, 1)  # [B, t-n+1, n]
            match = (windows == tail[:, None, :]).all(-1)
            # a window must end before the last token, so that something follows it
            match &= (cols[: t - n + 1][None, :] + n < length[:, None]) & (length[:, None] > n)
            has = match.any(1)
            first = match.int().argmax(1)
            take = has & ~found
            start = torch.where(take, first + n, start)
            found |= has
        n_drafts = torch.where(found, (length - start).clamp(max=k), torch.zeros_like(start))
        # verify only as many slots as the longest proposal: rows without a match would waste the rest
        w = int(n_drafts.max())
        idx = (start[:, None] + torch.arange(w, device=dev)[None, :]).clamp(max=t - 1)
        drafts = hist.gather(1, idx)
        drafts = torch.where(torch.arange(w, device=dev)[None, :] < n_drafts[:, None], drafts, 0)
        return Proposal(drafts, n_drafts)  # deterministic: q is one-hot on the proposal
