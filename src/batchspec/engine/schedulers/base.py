"""The scheduler interface. At each round boundary the engine asks:

- ``admit(running, waiting, batch_size) -> int``: how many waiting requests (in input order) join the running rows;
- ``select(lengths, batch_size) -> (rows | None, grouped | None)``: which running rows (indices into ``lengths``, the
  current length of each running row) form this round's batch, None for all of them; ``grouped`` says whether they
  all have one length (None when the scheduler does not group);
- ``forget(keep)``: rows finished, only ``keep`` remain (for schedulers that remember rows).

Outputs are returned in input order whatever the schedule.
"""


class Scheduler:
    name = "scheduler"

    def admit(self, running: int, waiting: int, batch_size: int) -> int:
        raise NotImplementedError

    def select(self, lengths: list[int], batch_size: int):
        return None, None

    def forget(self, keep: list[int]) -> None:
        """Only running rows ``keep`` (indices, in order) remain; the others finished. ``[]`` starts afresh."""
