"""The adaptive speculation length: each round's budget from measured costs and estimated acceptance.

A round is worth its expected tokens over its cost in plain steps (goodput, as in SmartSpec); a plain step is worth
one token a row for one step, so drafting pays only where some length promises more.

- Costs come from a profile of the target's and the drafter's forwards measured once on this machine
  (``costs.py``); live rounds do not change them, so one slow round (the machine busy elsewhere) cannot price a length
  out of reach, and a batch size seen for the first time is priced as well as any. Measured at two contexts, it
  prices each round at its rows' cached tokens, a draft at its own row's (``CostModel.context``).
- A round drafts only where it beats a plain step by ``plan.MARGIN``: its tokens are estimates.
- Acceptance comes from each row's own recent rounds, blended with the drafter's long-run rate (``acceptance.py``).
- A drafter whose offers carry candidates (prompt lookup, the feature-reading head with copies: they know per row
  what their candidates promise) gets its rounds sized per row or width from the costs in the ``DraftBudget`` and its
  offer (``plan.py``); for any other drafter (a draft model) the length is chosen here, one for the batch.
- With temperature > 0 the length stays K: the tokens a seed yields depend on how many were drafted, and a length
  chosen from timings would make seeded outputs depend on the machine's speed.

``budget`` only reads; ``observe`` (after the round's one host read) is the only place state changes.
"""

from __future__ import annotations

import torch

from .acceptance import Acceptance
from .budget import DRAFT, DRY, FIXED, NO_ROOM, NOT_WORTH, PROBE, DraftBudget, Outcome, RoundView
from .costs import CostModel, Profile, load_or_measure
from .plan import Plans, cheapest
from .row_values import row_values

# a drafter that sizes its own rounds and verified nothing for this many rounds in a row is asked again after
# ``LOOK_EVERY`` rounds, each wait twice the last up to ``LOOK_LONGEST``, until a round verifies drafts again (an ask,
# its matching and sizing, costs ~0.6 ms at 8 rows, ~1.5% of a step; on long prompts at 8 rows nothing pays for
# whole requests)
DRY_ROUNDS = 8
LOOK_EVERY = 4
LOOK_LONGEST = 16
# a draft model's length chosen as 0 for this many rounds in a row: one round drafts a single token, so that the rows'
# acceptance estimates (only drafting rounds bring evidence) stay current; the wait doubles, up to ``PROBE_LONGEST``
# times, while probes change nothing
PROBE_EVERY = 8
PROBE_LONGEST = 8


class AdaptiveLength(Plans):
    name = "adaptive"

    def __init__(self, costs: CostModel | Profile | None = None):
        """``costs``: a ``CostModel`` (or the ``Profile`` it reads) to price rounds with; None: the profile of this
        machine, models and batch size, measured or read from the cache when the engine binds the policy."""
        self.costs = CostModel(costs) if isinstance(costs, Profile) else costs
        self.acceptance = Acceptance()
        self.sizes_own = False  # whether the bound drafter's offers carry candidates its rounds are sized by
        self.idle = 0  # rounds in a row whose chosen length was 0 (a draft model's)
        self.interval = PROBE_EVERY  # rounds of 0 between probes
        self.unverified = 0  # rounds in a row that verified nothing (a drafter sizing its own rounds)
        self.headless = 0  # rounds in a row in which its head (a drafter with one) did not run

    def bind(self, target_runner, drafter, batch_size: int) -> None:
        """Price rounds for ``drafter`` over ``target_runner`` at up to ``batch_size`` rows (the profile is measured
        once per machine and cached; a few seconds the first time)."""
        self.sizes_own = drafter.sizes_own_drafts
        if self.costs is None:
            self.costs = CostModel(load_or_measure(target_runner, batch_size, drafter, drafter.needs_hidden))

    # ---------------------------------------------------------------------------------------------- decide
    def budget(self, view: RoundView) -> DraftBudget:
        """This round's budget (a query: nothing changes)."""
        if view.k_max == 0:
            return DraftBudget.plain(NO_ROOM)
        if view.seqs.sampling:
            return DraftBudget(view.k_max, reason=FIXED)
        if self.sizes_own:
            if self._resting():
                return DraftBudget.plain(DRY)
            return self._sized(view)
        best = self.best_length(view.rows, view.k_max)
        if best == 0:
            return DraftBudget(1, reason=PROBE) if self.idle + 1 >= self.interval else DraftBudget.plain(NOT_WORTH)
        return DraftBudget(best, reason=DRAFT)

    def dry(self) -> bool:
        """A drafter sizing its own rounds whose head did not run in the last round, or that verified nothing for
        ``DRY_ROUNDS`` rounds in a row (a query): rows joining now leave their prompt's pairs for its next catch-up,
        which the plan prices (caching them cost ~8% of their prefill at 4 rows, for a head that may not run again
        while they do: a server at 16 clients on long prompts drafts nothing)."""
        return self.sizes_own and (self.headless > 0 or self.unverified >= DRY_ROUNDS)

    def _resting(self) -> bool:
        """Past ``DRY_ROUNDS`` rounds that verified nothing, the drafter is asked after ``LOOK_EVERY`` more, then
        after each wait twice the last, up to ``LOOK_LONGEST`` (a query: the asks fall at fixed counts of dry
        rounds)."""
        over = self.unverified - DRY_ROUNDS
        if over < 0:
            return False
        wait, ask = LOOK_EVERY, LOOK_EVERY - 1  # the dry rounds past DRY_ROUNDS at which it is asked: 3, 11, 27, 43...
        while wait < LOOK_LONGEST and ask < over:
            wait *= 2
            ask += wait
        return over < ask or (over - ask) % wait != 0

    def _sized(self, view: RoundView) -> DraftBudget:
        """Costs for a drafter that sizes its own rounds: per row where the runner packs verification and every row
        may draft K (the round's drafts in all, up to what the runner packs), else per block width. With no request
        waiting, rows that finish last are worth more (``row_values``)."""
        rows, costs = view.rows, self.costs
        pack = view.packed_rows - rows
        per_row = rows > 1 and pack >= view.k_max
        most = min(view.k_max * rows, pack) if per_row else view.k_max
        verify = costs.verifies(rows, most, per_row)
        worth = row_values(view.seqs, costs.fixed_share(rows)) if per_row and not view.waiting else None
        return DraftBudget(view.k_max, verify, costs.step(rows), costs.pair(rows), per_row, worth, DRAFT,
                           costs.context(rows, view.seqs.length))

    def round_cost(self, rows: int, k: int) -> float:
        """A draft model's round of k drafts a row, in plain steps: verifying them, k forwards of the draft model
        (its first one also catches up on the tokens it missed) and the round's bookkeeping."""
        if k == 0:
            return 1.0
        return self.costs.verify(rows, k, False) + k * self.costs.step(rows) + self.costs.overhead(rows)

    def best_length(self, rows: int, k_max: int) -> int:
        """The length with the most expected tokens per plain step (``plan.cheapest``: a plain step counted
        ``MARGIN`` more, the shortest of equals)."""
        lengths = range(k_max + 1)
        tokens = torch.tensor([self.acceptance.tokens(k) for k in lengths], dtype=torch.float64)
        return int(cheapest(tokens, torch.tensor([self.round_cost(rows, k) for k in lengths], dtype=torch.float64)))

    # ---------------------------------------------------------------------------------------------- learn
    def record(self, seqs, accepted, k: int, plan=None, proposal=None, target=None) -> None:
        """What the round's drafts did (device only): each row's evidence, and the planner's acceptance."""
        self.acceptance.record(seqs, accepted, k)
        self.learn(plan, proposal, accepted, target)

    def estimates(self, seqs, k_max: int):
        """Per-row acceptance for the round's host read: only a draft model's length is chosen from them."""
        return None if self.sizes_own else self.acceptance.estimates(seqs, k_max)

    def observe(self, outcome: Outcome) -> None:
        """What the round did: the acceptance estimates it read, and the counters the next budgets read."""
        b = outcome.budget
        if outcome.values is not None:
            self.acceptance.update(outcome.values, b.k > 0)
        if self.sizes_own:
            self.unverified = 0 if outcome.drafted else self.unverified + 1
            self.headless = 0 if outcome.kind == "head" else self.headless + 1
            return
        if b.reason == PROBE:  # a probe that changed nothing: wait twice as long for the next one
            still = self.best_length(outcome.rows, outcome.k_max) == 0
            self.interval = min(2 * self.interval, PROBE_LONGEST * PROBE_EVERY) if still else PROBE_EVERY
            self.idle = 0
        elif b.reason == NOT_WORTH:
            self.idle += 1
        elif b.k:
            self.idle, self.interval = 0, PROBE_EVERY
