"""EQSPEC (the paper's method): after every round, unpad-append-repad so that each row is left-padded, rectangular
and free of holes. The KV move of target and draft caches is one gather per cache; positions follow the mask."""

from ...batch import SlotState, compact_index


class EqSpec:
    name = "eqspec"

    def align(self, state: SlotState, width: int) -> None:
        index, pad = compact_index(state.valid, min(width, state.width))  # a draft that skipped rounds is narrower
        state.gather(index, pad)
