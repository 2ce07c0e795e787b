"""No drafter: every round verifies only the pending token, which is plain batched greedy decoding (and the tokens
rows' grammars force, where a plan carries them)."""

import torch

from .base import Drafter, Proposal


class NoDrafter(Drafter):
    name = "none"
    takes_forced = True

    def propose(self, seqs, state, plan):
        if plan.forced is None:
            return Proposal.empty(len(seqs), seqs.length.device)
        drafts = torch.zeros((len(seqs), plan.width), dtype=torch.long, device=seqs.length.device)
        return self.forced_first(plan, drafts, torch.zeros_like(plan.n_forced))
