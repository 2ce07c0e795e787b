"""The batch layer: the running rows and their cache slots, below the drafters, the speculation decision and the
engine, above the model (whose ``kv`` module is the one door to a cache's tensors).

- ``slots.py``: ``SlotState``, one model's rectangle of cache slots (valid, token, position per slot), the layouts'
  ``compact_index`` and the invariants I1 / I2 (``check_invariants``, ``InvariantError``).
- ``sequences.py``: ``Sequences``, per-request state on the device (history, lengths, limits, sampling parameters).
- ``rows.py``: ``Batch``, the rows in one value (sequences, target slots, the drafter's state) with its row operations.
- ``grammar.py``: structured output's matchers, their masks over a round's positions and their advance.
- ``prefilling.py``: ``prefill``, prompts into a new ``SlotState`` (grouped forwards, shared and kept prefixes).
"""

from .prefilling import FEATURES, prefill
from .rows import Batch
from .sequences import RoundLogprobs, Sequences
from .slots import InvariantError, SlotState, check_invariants, compact_index

__all__ = ["FEATURES", "Batch", "InvariantError", "RoundLogprobs", "Sequences", "SlotState", "check_invariants",
           "compact_index", "prefill"]
