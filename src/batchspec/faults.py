"""Injected faults reproducing published bug classes; each replaces exactly one component of ``engine.Parts``."""

FAULTS: dict = {}


def apply_fault(parts, name):
    if name is None:
        return parts
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose one of {sorted(FAULTS)}")
    return FAULTS[name](parts)
