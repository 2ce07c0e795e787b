"""Drafters offer and draft up to K tokens per row (interface in ``base``): ``prefill(prompts) -> state``,
``offer(seqs, state, k) -> Offer`` (what they could draft), ``propose(seqs, state, plan) -> Proposal`` (exactly the
plan speculation made of the offer), ``commit(state, proposal, accepted, target_output)``, ``states(state)`` (the
caches a layout keeps aligned) and ``processed(seqs, state)`` (tokens each of those must hold, for the invariant
checker). The running batch owns each drafter's state."""

from .base import Drafter, Proposal
from .eagle import EagleDrafter, EagleState
from .lookup import PromptLookup
from .model import DraftState, ModelDrafter
from .none import NoDrafter

__all__ = ["Drafter", "DraftState", "EagleDrafter", "EagleState", "ModelDrafter", "Proposal", "PromptLookup", "NoDrafter"]
