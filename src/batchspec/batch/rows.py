"""The running rows in one value: their sequences, the target's slots and the drafter's per-row state."""

from __future__ import annotations

import torch

from .slots import SlotState


class Batch:
    """The running rows, in one place: their sequences (``Sequences``), the target's slots, the drafter's per-row
    state (None for drafters without one) and each row's current length (prompt + generated, on the host, read with
    the round's one host sync). Row operations are written once, here, for all of them."""

    def __init__(self, seqs, target: SlotState, draft, lengths: list[int]):
        self.seqs, self.target, self.draft, self.lengths = seqs, target, draft, lengths

    def _parts(self):
        return (self.seqs, self.target) if self.draft is None else (self.seqs, self.target, self.draft)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def request_ids(self) -> list[int]:
        return self.seqs.request_ids

    def select_rows(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (host indices, ``new[i] = old[keep[i]]``)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.seqs.length.device)
        for part in self._parts():
            part.select_rows(idx)
        self.lengths = [self.lengths[i] for i in keep]

    def take(self, rows: list[int]) -> "Batch":
        """A copy of ``rows`` (a batch drawn from a larger window)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.seqs.length.device)
        return Batch(*(part.take(idx) for part in self._parts()), *(() if self.draft is not None else (None,)),
                     [self.lengths[i] for i in rows])

    def put(self, rows: list[int], part: "Batch") -> None:
        """Write back what ``take(rows)`` returned, after a round."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.seqs.length.device)
        for mine, theirs in zip(self._parts(), part._parts()):
            mine.put(idx, theirs)
        for r, length in zip(rows, part.lengths):
            self.lengths[r] = length

    def merge(self, other: "Batch") -> "Batch":
        """This batch's rows followed by ``other``'s (requests joining)."""
        merged = [mine.merge(theirs) for mine, theirs in zip(self._parts(), other._parts())]
        return Batch(*merged, *(() if self.draft is not None else (None,)), self.lengths + other.lengths)
