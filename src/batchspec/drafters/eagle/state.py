"""The head's per-row state: its slot cache of (feature, next token) pairs and the target's features it has not
cached yet (right-aligned; rounds that did not run the head set theirs aside, joined once when it next runs)."""

from __future__ import annotations

import torch

from ...batch import SlotState
from ...model.kv import move_rows


class EagleState:
    """Per row: the head's slots, ``processed`` ``[B]`` (pairs cached) and ``feats`` ``[B, W, H]``, the target's
    features of the last ``W`` positions before the pending token, right-aligned (``W`` covers every pair a row has
    not cached; columns further left are holes)."""

    def __init__(self, slots: SlotState, processed: torch.Tensor, feats: torch.Tensor):
        self.slots, self.processed, self.feats = slots, processed, feats

    @property
    def feats(self) -> torch.Tensor:
        if self.aside:  # join the rounds that did not run the head once, not once per round
            self._feats, self.aside = _join(self._feats, self.aside), []
        return self._feats

    @feats.setter
    def feats(self, value: torch.Tensor) -> None:
        # aside: per round that did not run the head, its features ``[B, n, H]`` and how many of them are real per
        # row (None: all), not joined yet
        self._feats, self.aside = value, []

    @property
    def waiting(self) -> int:
        """A bound on the pairs a row waits to have cached (the feature columns kept, not joined yet)."""
        return self._feats.shape[1] + sum(h.shape[1] for h, _ in self.aside)

    def select_rows(self, rows):
        self.slots.select_rows(rows)
        self.processed = self.processed[rows]
        # the kept features move in place (a batch of long prompts keeps ~14 MB of them), the rounds aside stay aside
        self._feats = move_rows(self._feats, rows)
        self.aside = [(h[rows], None if n is None else n[rows]) for h, n in self.aside]

    def take(self, rows) -> "EagleState":
        return EagleState(self.slots.take(rows), self.processed[rows], self.feats[rows])

    def put(self, rows, part: "EagleState") -> None:
        self.slots.put(rows, part.slots)
        self.processed[rows] = part.processed
        mine, theirs = self.feats, part.feats
        t = max(mine.shape[1], theirs.shape[1])
        self.feats = _left_pad(mine, t)
        self.feats[rows] = _left_pad(theirs, t)

    def merge(self, other: "EagleState") -> "EagleState":
        mine, theirs = self.feats, other.feats
        t = max(mine.shape[1], theirs.shape[1])
        return EagleState(self.slots.merge(other.slots), torch.cat([self.processed, other.processed]),
                          torch.cat([_left_pad(mine, t), _left_pad(theirs, t)]))


def _left_pad(feats: torch.Tensor, t: int) -> torch.Tensor:
    return feats if feats.shape[1] == t else torch.nn.functional.pad(feats, (0, 0, t - feats.shape[1], 0))


def _join(feats: torch.Tensor, rounds: list) -> torch.Tensor:
    """``feats`` followed by each round's features, every row's real ones moved right (its holes to the left), as
    wide as the row with the most."""
    joined = torch.cat([feats, *(h for h, _ in rounds)], 1)
    if all(n is None for _, n in rounds):
        return joined
    real = torch.cat([torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)] + [
        torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if n is None
        else torch.arange(h.shape[1], device=h.device)[None, :] < n[:, None] for h, n in rounds], 1)
    width = int(real.sum(1).max())  # one host read when the head next runs after rounds that copied
    order = real.to(torch.uint8).sort(dim=1, stable=True).indices[:, real.shape[1] - width:]
    return joined.gather(1, order[..., None].expand(-1, -1, joined.shape[-1]))
