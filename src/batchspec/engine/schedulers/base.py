"""The scheduler interface. At each round boundary the engine asks:

- ``admit(running, waiting, batch_size, token_budget, fits) -> int``: how many waiting requests (in input order;
  ``waiting`` their prompt lengths) join the running rows: as many as the scheduler has ``room`` for, and, while rows
  are running, no more than ``token_budget`` prompt tokens of them (at least one; None: no budget), and no more than
  the KV memory ``fits`` (``fits(n)``: the first n may join; None: no bound);
- ``select(lengths, batch_size) -> (rows | None, grouped | None)``: which running rows (indices into ``lengths``, the
  current length of each running row) form this round's batch, None for all of them; ``grouped`` says whether they
  all have one length (None when the scheduler does not group);
- ``forget(keep)``: rows finished, only ``keep`` remain (for schedulers that remember rows).

Outputs are returned in input order whatever the schedule.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence


class Scheduler:
    name = "scheduler"
    # whether requests join while rows run (the engine then lets cheap prompts go first, ``Engine._kept_first``); a
    # batch that runs whole is not split for them
    joins_running = True

    def admit(self, running: int, waiting: Sequence[int], batch_size: int, token_budget: int | None = None,
              fits: Callable[[int], bool] | None = None) -> int:
        """How many of the ``waiting`` requests (their prompt lengths, in order) join ``running`` rows: up to ``room``,
        and while rows are running, those whose prompts fit ``token_budget`` tokens (at least one), so that a burst of
        long prompts does not stall the running rows for all of them at once; then as many as ``fits`` the KV memory
        (none, until rows leave: a request too large for the budget alone never gets this far)."""
        n = min(len(waiting), self.room(running, batch_size))
        if n > 1 and running and token_budget is not None:
            total, fits_tokens = 0, 0
            for length in itertools.islice(waiting, n):
                total += length
                if fits_tokens and total > token_budget:
                    break
                fits_tokens += 1
            n = fits_tokens
        while n > 0 and fits is not None and not fits(n):
            n -= 1
        return max(n, 0)

    def room(self, running: int, batch_size: int) -> int:
        """How many requests may join ``running`` rows (before the token budget)."""
        raise NotImplementedError

    def select(self, lengths: list[int], batch_size: int):
        return None, None

    def forget(self, keep: list[int]) -> None:
        """Only running rows ``keep`` (indices, in order) remain; the others finished. ``[]`` starts afresh."""
