"""Continuous batching: whenever rows finish, waiting requests are prefilled and spliced into the running batch at
the next round boundary (with either layout), so the batch stays full while there is work."""

from .base import Scheduler


class Continuous(Scheduler):
    name = "continuous"

    def room(self, running: int, batch_size: int) -> int:
        return batch_size - running
