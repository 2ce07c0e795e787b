"""Drafters propose up to K tokens per row. One interface:

``add(prompts)``, ``propose(seqs, k) -> (drafts [B, k], n_drafts [B], q [B, k, V] | None)``, ``commit(accepted [B], k)``,
``select_rows(rows)``, ``reset()``, ``states`` (the caches a layout must keep aligned) and ``processed(seqs)`` (tokens each of
those caches must hold, for the invariant checker).
"""

from .lookup import PromptLookup
from .model import ModelDrafter
from .base import Drafter
from .none import NoDrafter

__all__ = ["Drafter", "ModelDrafter", "PromptLookup", "NoDrafter"]
