"""How much to draft each round: the whole decision lives here. Drafters offer, speculation decides: a drafter says
what it could draft (``Offer``), the policy's planner picks how many drafts, for which rows and of which kind
(``DraftPlan``), and the drafter drafts exactly that.

- ``budget.py``: ``DraftBudget``, the one value the decision hands a drafter (what it may draft, what a round
  verifying m drafts costs, what a token of each row is worth, and why), ``RoundView`` (what the decision reads) and
  ``Outcome`` (what a round did); the reasons rounds are counted by (``Stats.decisions``).
- ``costs.py``: the cost model, a profile of the target's and the drafter's forwards measured once per machine and
  cached (``batchspec profile``).
- ``acceptance.py``: the estimators: expected tokens per round from each row's recent evidence and the drafter's
  long-run rate; copies' acceptance per match length and index; a head's first drafts (one ``PRIOR_WEIGHT``).
- ``plan.py``: ``Offer``, ``DraftPlan``, the planner (each kind and size of round priced by ``cheapest``, the one
  pricing routine: expected tokens over cost in plain steps) and what it learns from each round.
- ``row_values.py``: what a token of each row is worth when the batch runs until its last row is done.
- ``fixed.py`` / ``adaptive.py``: the policies (``speculation="fixed"`` / ``"adaptive"``, the default).

A policy has ``bind(target_runner, drafter, batch_size)``, ``budget(view) -> DraftBudget`` (a query), and the hooks
the engine calls around each round: ``plan(offer, budget) -> DraftPlan``, ``record`` (device-side evidence, the
planner's acceptance counts included), ``estimates`` (a device tensor read with the round's one host read, or None)
and ``observe(outcome)`` (the only place its host-side state changes).
"""

from .acceptance import expected_tokens
from .adaptive import AdaptiveLength
from .budget import REASONS, DraftBudget, Outcome, RoundView
from .costs import CostModel, Profile
from .fixed import FixedLength
from .plan import DraftPlan, Offer
from .row_values import row_values

POLICIES = {"fixed": FixedLength, "adaptive": AdaptiveLength}


def get_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown speculation {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()


__all__ = ["AdaptiveLength", "CostModel", "DraftBudget", "DraftPlan", "FixedLength", "Offer", "Outcome", "POLICIES",
           "Profile", "REASONS", "RoundView", "expected_tokens", "get_policy", "row_values"]
