"""SLOTMASK: never move the cache per round. Rejected slots become holes that the attention mask hides, and position
ids count the valid tokens before each slot, so holes are invisible to the model. The cache is compacted (one
gather, as in EQSPEC) only when holes and padding exceed ``max_waste`` of its width."""

from ...batch import SlotState, compact_index


class SlotMask:
    name = "slotmask"

    def __init__(self, max_waste: float = 0.5):
        if not 0.0 <= max_waste < 1.0:
            raise ValueError(f"max_waste must be in [0, 1), got {max_waste}")
        self.max_waste = max_waste

    def align(self, state: SlotState, width: int) -> None:
        if state.width - width > self.max_waste * state.width:
            index, pad = compact_index(state.valid, width)
            state.gather(index, pad)
