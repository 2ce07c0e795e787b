"""EXSPEC (the paper's cross-batch scheduling): keep a window of up to ``window`` x batch_size running requests and,
each round, run a batch of rows that all have the same current length, so the batch needs no realignment. When no
length has a full batch of rows, fall back to the largest groups (the layout realigns that batch). The window refills
from the waiting requests as rows finish (so, unlike the paper, requests also join a running window).

A row that sat out ``max_wait`` consecutive rounds is served first, in a fallback batch if need be, which bounds the
wait of rows whose length never matches a full group (the tail-latency limitation the paper notes).
"""

from collections import Counter

from .base import Scheduler


class ExSpec(Scheduler):
    name = "exspec"

    def __init__(self, window: int = 4, max_wait: int = 8):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1 (a multiple of the batch size), got {window!r}")
        self.window, self.max_wait = window, max_wait
        self.waits: list[int] = []  # consecutive rounds each running row sat out

    def room(self, running: int, batch_size: int) -> int:
        return self.window * batch_size - running

    def select(self, lengths: list[int], batch_size: int):
        waits = self.waits + [0] * (len(lengths) - len(self.waits))  # rows that joined since last round
        if len(lengths) <= batch_size:
            rows = list(range(len(lengths)))
        else:
            count = Counter(lengths)
            starving = [i for i in range(len(lengths)) if waits[i] >= self.max_wait]
            # rank rows: starving rows first, then by the size of their length group, then oldest first
            order = sorted(range(len(lengths)), key=lambda i: (i not in starving, -min(count[lengths[i]], batch_size),
                                                               lengths[i], i))
            rows = sorted(order[:batch_size])
        chosen = set(rows)
        self.waits = [0 if i in chosen else w + 1 for i, w in enumerate(waits)]
        return (None if len(rows) == len(lengths) else rows), len({lengths[i] for i in rows}) == 1

    def forget(self, keep: list[int]) -> None:
        self.waits = [self.waits[i] for i in keep]
