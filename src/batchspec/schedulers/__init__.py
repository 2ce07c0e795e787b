"""Schedulers decide, at each round boundary, how many waiting requests join the running batch.

One method: ``admit(running, waiting, batch_size) -> int``. Requests join in input order; outputs are returned in
input order whatever the schedule.
"""

from .continuous import Continuous
from .static import Static

SCHEDULERS = {"static": Static, "continuous": Continuous}


def get_scheduler(name: str):
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name]()
