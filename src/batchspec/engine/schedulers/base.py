"""The scheduler interface. At each round boundary the engine asks:

- ``admit(running, waiting, batch_size, token_budget) -> int``: how many waiting requests (in input order; ``waiting``
  their prompt lengths) join the running rows: as many as the scheduler has ``room`` for, and, while rows are running,
  no more than ``token_budget`` prompt tokens of them (at least one; None: no budget);
- ``select(lengths, batch_size) -> (rows | None, grouped | None)``: which running rows (indices into ``lengths``, the
  current length of each running row) form this round's batch, None for all of them; ``grouped`` says whether they
  all have one length (None when the scheduler does not group);
- ``forget(keep)``: rows finished, only ``keep`` remain (for schedulers that remember rows).

Outputs are returned in input order whatever the schedule.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class Scheduler:
    name = "scheduler"

    def admit(self, running: int, waiting: Sequence[int], batch_size: int, token_budget: int | None = None) -> int:
        """How many of the ``waiting`` requests (their prompt lengths, in order) join ``running`` rows: up to ``room``,
        and while rows are running, those whose prompts fit ``token_budget`` tokens (at least one), so that a burst of
        long prompts does not stall the running rows for all of them at once."""
        n = min(len(waiting), self.room(running, batch_size))
        if n > 1 and running and token_budget is not None:
            total, fits = 0, 0
            for length in itertools.islice(waiting, n):
                total += length
                if fits and total > token_budget:
                    break
                fits += 1
            n = fits
        return max(n, 0)

    def room(self, running: int, batch_size: int) -> int:
        """How many requests may join ``running`` rows (before the token budget)."""
        raise NotImplementedError

    def select(self, lengths: list[int], batch_size: int):
        return None, None

    def forget(self, keep: list[int]) -> None:
        """Only running rows ``keep`` (indices, in order) remain; the others finished. ``[]`` starts afresh."""
