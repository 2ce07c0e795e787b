"""Prompt lookup (model-free n-gram drafting, as HF's ``prompt_lookup_num_tokens``), batched: it offers each row's
candidates and the key their acceptance is learned by; speculation sizes the round (``speculation.plan``).

For n from ``max_ngram`` down to ``min_ngram``, find the latest earlier occurrence of each row's last n tokens in
its own prompt + generated tokens; the longest n that occurs is the row's *match length*, and the tokens that
followed that occurrence are its candidate drafts (the latest occurrence: a passage being copied or a phrase being
repeated continues like its most recent use). Rows with no match propose none.

How far a copy goes on being right depends on how long the match is (a 1-token match is a weak hint; an 8-token one
usually means the model is copying a passage), so the offer carries each row's match length: speculation learns
acceptance per match length and draft index and picks how many of each row's candidates the round verifies (every
candidate without costs or under sampling). The block is as wide as the longest proposal in the batch, so a round
where nothing was worth drafting costs one plain decoding step.
"""

import torch

from ..model.kernels import lookup_match
from ..speculation.plan import DraftPlan, Offer
from .base import Drafter, Proposal, widened


class PromptLookup(Drafter):
    name = "prompt-lookup"
    sizes_own_drafts = True  # its offers carry candidates that speculation sizes rows by
    packs_rows = True
    takes_forced = True

    def __init__(self, max_ngram: int = 8, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def offer(self, seqs, state, k: int) -> Offer:
        """Each row's candidates up to k and its match length (speculation's key for their acceptance)."""
        drafts, n_drafts, match = self.candidates(seqs, k)
        return Offer(len(seqs.length), seqs.length.device, drafts, n_drafts, match, self.max_ngram + 1,
                     sampling=seqs.sampling)

    def propose(self, seqs, state, plan: DraftPlan) -> Proposal:
        """The first ``plan.drafts`` of each row's candidates (deterministic: q is one-hot on the proposal), after
        its forced tokens."""
        w, n, c = plan.width, plan.drafts, plan.offer.candidates
        drafts = torch.where(torch.arange(w, device=n.device)[None, :] < n[:, None], widened(c, len(n), w, n.device), 0)
        return self.forced_first(plan, drafts, n)

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
