"""Static batching: a batch of ``batch_size`` requests runs until every row has finished (finished rows leave the
batch, nobody joins); then the next batch starts."""

from .base import Scheduler


class Static(Scheduler):
    name = "static"
    joins_running = False

    def room(self, running: int, batch_size: int) -> int:
        return batch_size if running == 0 else 0
