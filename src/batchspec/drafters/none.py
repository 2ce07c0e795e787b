"""No drafter: every round verifies only the pending token, which is plain batched greedy decoding."""

from .base import Drafter, Proposal


class NoDrafter(Drafter):
    name = "none"

    def propose(self, seqs, state, plan):
        return Proposal.empty(len(seqs), seqs.length.device)
