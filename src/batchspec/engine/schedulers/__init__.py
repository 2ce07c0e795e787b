"""Schedulers decide, at each round boundary, which waiting requests join and which running rows form the batch
(interface in ``base``)."""

from .base import Scheduler
from .continuous import Continuous
from .exspec import ExSpec
from .static import Static

SCHEDULERS = {"static": Static, "continuous": Continuous, "exspec": ExSpec}


def get_scheduler(name: str, **kwargs) -> Scheduler:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    return SCHEDULERS[name](**kwargs)
