"""How ragged rows live in one rectangular cache. A layout has one method, ``align(state, width)``, called after every
round for every cache (target and draft): ``width`` is the largest number of valid slots any row needs."""

from .eqspec import EqSpec
from .slotmask import SlotMask

LAYOUTS = {"slotmask": SlotMask, "eqspec": EqSpec}


def get_layout(name: str, **kwargs):
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; choose one of {sorted(LAYOUTS)}")
    return LAYOUTS[name](**kwargs)
