"""``EngineConfig``: what an ``LLM`` is built from, one field per argument of ``LLM(...)``, so that the server, Ray
workers and the command line hand one object on instead of each copying the list of arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields

from .engine import memory
from .model.prefixes import budget_bytes
from .model.runner import Runner


@dataclass
class EngineConfig:
    """The arguments of ``LLM(...)`` (see ``LLM`` for what each means); ``LLM.from_config`` builds one from it.

    ``target``, ``draft`` and ``tokenizer`` are what ``LLM`` loads: paths, model ids, built-in names, or objects
    already built. The values that need no model are checked here, so a bad one fails before anything loads."""

    target: object
    draft: object = None
    tokenizer: object = None
    num_draft_tokens: int = 5
    layout: str = "slotmask"
    scheduler: object = "static"
    batch_size: int = 8
    dtype: object = None
    device: object = None
    check_invariants: bool = False
    fault: str | None = None
    profile: bool = False
    speculation: object = "adaptive"
    graphs: str = "auto"
    weights: str = "auto"
    prefix_cache: int | None = None
    kv_memory: int | None = None

    def __post_init__(self):
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {self.num_draft_tokens!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        budget_bytes(self.prefix_cache)
        memory.budget_bytes(self.kv_memory)
        if self.graphs not in Runner.GRAPH_MODES:
            raise ValueError(f"graphs must be one of {Runner.GRAPH_MODES}, got {self.graphs!r}")

    def kwargs(self) -> dict:
        """The fields as ``LLM``'s keyword arguments (the values themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
