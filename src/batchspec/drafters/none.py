"""No drafter: every round verifies only the pending token, which is plain batched greedy decoding."""

import torch

from .base import Drafter, Proposal


class NoDrafter(Drafter):
    name = "none"

    def propose(self, seqs, state, k):
        b, dev = seqs.length.shape[0], seqs.length.device
        return Proposal(torch.empty((b, 0), dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev))
