"""Schedulers decide which requests run together. ``static``: fixed batches in input order, each run to completion
(finished rows leave the batch, nobody joins)."""

from .static import static_batches

SCHEDULERS = {"static": static_batches}


def get_scheduler(name: str):
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name]
