"""The feature-reading draft head (EAGLE) with prompt lookup's copies: ``drafter`` (proposing and committing each
round), ``state`` (the per-row cache and features); each greedy round's kind and width are planned in
``batchspec.speculation.plan``, training lives in ``batchspec.training``."""

from .drafter import EXTRA, EagleDrafter, is_checkpoint
from .state import EagleState

__all__ = ["EXTRA", "EagleDrafter", "EagleState", "is_checkpoint"]
