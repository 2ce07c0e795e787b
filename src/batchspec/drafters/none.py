"""No drafter: every round verifies only the pending token, which is plain batched greedy decoding."""

import torch


class NoDrafter:
    name = "none"
    states = ()

    def prefill(self, prompts):
        pass

    def propose(self, seqs, k):
        b = seqs.length.shape[0]
        dev = seqs.length.device
        return torch.empty((b, 0), dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev)

    def commit(self, accepted, k):
        pass

    def select_rows(self, rows):
        pass
