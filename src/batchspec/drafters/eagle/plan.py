"""How a greedy round of the feature-reading head is planned: which kind of round (copies only, the head, or a plain
step) and how wide, from each kind's expected tokens over its cost in plain steps (the round's ``DraftBudget``). The
acceptance it plans with is learned here: prompt lookup's per match length and index, and the head's first drafts
(scored in every round that runs the head)."""

from __future__ import annotations

import torch

from ...speculation.budget import DraftBudget
from ..base import Proposal
from ..lookup import PRIOR_WEIGHT, PromptLookup, likeliest

# rounds that draft copies only (the head does not run) / that run the head (after any copies)
KINDS = ("copy", "head")
# the head catching up on a long wait (its features set aside by rounds that did not run it) is paid once for the head
# rounds it makes possible: its cost is shared by this many rounds, and by no more than the rounds left (the most
# tokens a row may still generate). Priced whole against one round, it lost to a plain or copy round, the wait grew by
# a pair a row every round the head did not run, and the head never ran again.
CATCH_UP_SHARED = 8
# a head round drafts on while some row's drafts are at least this likely by the head's own probabilities (their
# product, copies counting 1); 0.25 and 0.6 did no better on a 2-core CPU (docs/speculation.md). None: the planned
# width, drafted whole.
DEPTH_CONFIDENCE = 0.4


class RoundPlanner:
    """The plan of each greedy round of a head drafting with copies (``copy``: its prompt lookup); ``table`` ``[2]``:
    the head's first drafts accepted / scored."""

    def __init__(self, copy: PromptLookup):
        self.copy = copy
        self.table = None

    def plan(self, copies, n_copies, match, budget: DraftBudget, waiting: int = 0, left=None):
        """``(kind, width, rows that copy, drafts per row of a copy round)`` for a greedy round of at most
        ``budget.k`` drafts. A row copies first when its match length's first copied draft is accepted more often than
        the head's first draft. Each kind of round and size is worth its expected tokens over its cost in plain steps
        (``round_costs``): "copy" rounds verify only the copies (rows without a match draft nothing; the head does
        not run), "head" rounds run the head for j steps (it drafts on after the copies). Where rows are sized one by
        one (``budget.per_row``), a copy round verifies the m likeliest copies of the batch (each row's first ones),
        m = 0..rows x k, priced by the drafts it verifies in all, and a head round of width j verifies rows x j
        drafts. ``waiting``: the pairs each row waits to have cached; ``left``: the most tokens a row may still
        generate (a device scalar), or None for many. Without costs (fixed length, sampling): a "head" round of k."""
        k = budget.k
        dev, b = match.device, len(match)
        col = torch.arange(k, device=dev)[None, :]
        copied = self.copy.survival(k, dev)[match] * (col < n_copies[:, None])  # [B, k] P(copies 1..j accepted)
        head = self.head_survival(k, dev)  # [k]
        use = (n_copies > 0) & (copied[:, 0] > head[0])
        if not budget.sized:
            return "head", k, use, None
        last = copied.gather(1, (n_copies - 1).clamp(min=0)[:, None])
        mixed = torch.where(col < n_copies[:, None], copied, last * head[(col - n_copies[:, None]).clamp(min=0)])
        mixed = torch.where(use[:, None], mixed, head[None, :])
        per = b if budget.per_row else 1  # drafts verified per unit of a head round's width
        if per > 1:  # a copy round's m copies of the batch worth most: E(m), m = 0..b*k
            copied, mixed = budget.weigh(copied), budget.weigh(mixed)  # each row's expected tokens at its worth
            gain, rank = likeliest(copied)
        else:  # one width for the batch: E(j), j = 0..k, from each column's expected accepted drafts
            gain = copied.sum(0).cumsum(0)
        pad = torch.nn.functional.pad
        tokens = b + torch.cat([pad(gain, (1, 0)), pad(mixed.sum(0).cumsum(0), (1, 0))])  # copy m, then head j
        price = self.round_costs(budget, dev, waiting, per, left)  # [copy / head, m = 0..k*per]
        best = (tokens / torch.cat([price[0], price[1, ::per]])).argmax()  # the first of equals: a plain step
        copy_round = best <= k * per
        if per > 1:  # a copy round of m drafts: each row's first ones among the m likeliest
            n = torch.where(copy_round, (rank < best).sum(1), 0)
        else:
            n = torch.where(copy_round, n_copies.clamp(max=best), 0)
        best, width = torch.stack([best, n.max()]).tolist()  # the round's host read
        if best <= k * per:
            return "copy", width, use, n
        return "head", best - k * per - 1, use, None

    def round_costs(self, budget: DraftBudget, device, waiting: int = 0, per: int = 1, left=None) -> torch.Tensor:
        """``[copy / head, m]``: a round verifying m = 0..k x ``per`` drafts in all, in plain steps (``per``: the rows
        of a round sized row by row, where a head round of width j verifies j x rows; else 1, and m is the width). A
        copy round costs its verification (``budget.verify``); a head round of j steps that plus j forwards of the
        head (``budget.step``), and, when the head waits to cache more pairs than a round's block, those pairs
        (``budget.pair`` each) shared by ``CATCH_UP_SHARED`` rounds (or the rounds ``left``, if fewer). Sizes past
        what the budget prices (what the runner packs) cost ``inf``; costs never fall with m."""
        n = budget.k * per
        copy = budget.verify_tensor(n, device)
        steps = torch.arange(n + 1, device=device, dtype=torch.float64) / per
        head = copy + budget.step * steps
        extra = max(waiting - (budget.k + 1), 0)  # pairs beyond what a head round's first forward always covers
        if extra and budget.pair:
            shared = CATCH_UP_SHARED if left is None else left.clamp(1, CATCH_UP_SHARED)  # on the device: no read
            head = head + budget.pair * extra / shared
        return torch.stack([copy, head]).cummax(1).values

    def head_survival(self, k: int, device) -> torch.Tensor:
        """``[k]`` P(the head's drafts 1..j all accepted): its first-draft rate (``PRIOR_WEIGHT`` pseudo-rounds at
        0.5) to the power j. Measured per index under training-time test, the later drafts' rates given the earlier
        accepted are about the first's (0.41 / 0.40 / 0.44 / 0.46 on the built-in prompts), and unlike them the
        first is scored in every round that runs the head, so a width seldom drafted is not priced from stale
        evidence."""
        hits, scored = self._first_drafts(device)
        rate = (hits + PRIOR_WEIGHT * 0.5) / (scored + PRIOR_WEIGHT)
        return rate ** torch.arange(1, k + 1, device=device, dtype=torch.float64)

    def _first_drafts(self, device) -> torch.Tensor:
        """``[2]``: the head's first drafts accepted / scored."""
        if self.table is None or self.table.device != device:
            self.table = torch.zeros(2, dtype=torch.float64, device=device)
        return self.table

    def learn(self, proposal: Proposal, accepted: torch.Tensor, target) -> None:
        """Acceptance of copies (per match length and index) and of the head's first drafts. Both first drafts are
        scored in every round that runs the head, whichever was drafted (the target's first token is known); the
        copies' later indices where drafted."""
        if proposal.kind == "copy":
            self.copy.commit(None, proposal, accepted, target)
            return
        match, n_copies, copied, head, use = proposal.match.unbind(1)
        token = target.tokens()[:, 0]
        use = use.bool()
        weak = (n_copies > 0) & ~use  # copies not drafted: their first one scored all the same
        offered = torch.where(use, n_copies.clamp(max=proposal.drafts.shape[1]), weak.long())
        right = torch.where(use, torch.minimum(accepted, offered), (weak & (copied == token)).long())
        self.copy.commit(None, Proposal(proposal.drafts, offered, match=match), right, target)
        table = self._first_drafts(token.device)
        table[0] += (head == token).sum()
        table[1] += len(token)
