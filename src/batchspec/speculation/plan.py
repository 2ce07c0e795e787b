"""Drafters offer, speculation decides: what a drafter could draft this round (``Offer``), how many drafts each row
drafts, of which kind (``DraftPlan``, from ``Planner.plan``), and the one pricing routine every size is chosen by
(``cheapest``: expected tokens over cost in plain steps). The planner also learns, from each round's accepted counts,
how often copies and a head's first drafts are accepted (``acceptance.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .acceptance import Copies, HeadRate
from .budget import DraftBudget

# the kinds of greedy round of a head drafting with copies: copies only (the head does not run) / the head runs
# (after any copies)
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
# a round drafts only where its expected tokens per plain step beat a plain step's by this share: its tokens are
# estimates (acceptance learned per match length, rows' worth from their limits) and its price is within ~5% (live
# forwards at 3-8 rows: 0.96-1.06 of it), so a round priced at break-even lost as often as it won. At 8 rows on a
# 2-core CPU copy rounds priced near break-even made the batch 0.93-0.98x plain (Spec-Bench, 128 tokens); with 10%
# none is chosen there (0.97-1.00x), and at batch 1 the same copy rounds as without (1.1x)
MARGIN = 0.1


@dataclass
class Offer:
    """What a drafter could draft this round (it drafts nothing yet). Without ``candidates`` the drafter drafts up to
    the budget's k a row its default way (a model's drafts are not known before it runs)."""

    rows: int
    device: torch.device
    candidates: torch.Tensor | None = None  # [B, k] each row's candidate copies (entries past its count are 0)
    count: torch.Tensor | None = None  # [B] candidates per row (0: no match)
    match: torch.Tensor | None = None  # [B] the estimator's key of each row's copies: its match length
    keys: int = 0  # the values ``match`` takes (0 .. keys - 1)
    kinds: tuple[str, ...] = ()  # the kinds of round it can run (``KINDS``; none: one kind, not counted)
    sampling: bool = False  # sampled rounds draft every candidate: a seed's tokens never depend on what ran before
    waiting: int = 0  # a head round's cost term: the pairs each row waits to have cached (a bound)
    left: torch.Tensor | None = None  # [] the most tokens a row may still generate (None: many)


@dataclass
class DraftPlan:
    """What the round drafts, decided before it: ``drafts`` ``[B]`` per row (in a block ``width`` wide), of ``kind``
    (None where the drafter has one kind), and why (``reason``, ``budget.REASONS``). A head round drafts copies first
    in the rows of ``use`` ``[B]``; with ``sure`` it drafts on, up to ``most`` steps, while some row's drafts are at
    least that likely by the head's own probabilities, and stops once none is (``rowwise``: each row verifies its
    drafts up to the first it is not sure of)."""

    offer: Offer
    kind: str | None
    drafts: torch.Tensor  # [B]
    width: int
    reason: str
    use: torch.Tensor | None = None  # [B] bool
    sure: float | None = None
    most: int = 0
    rowwise: bool = False
    forced: torch.Tensor | None = None
    n_forced: torch.Tensor | None = None


def with_forced(plan: DraftPlan | None, forced: torch.Tensor, counts: list[int], reason: str) -> DraftPlan:
    """``plan`` (None: the round drafts nothing) with the tokens rows' grammars force (``batch.grammar.forced``):
    they are each row's first drafts, its own ones after them kept only where they agree (``Drafter.propose``), and
    the block widens to hold them. Rows with none keep their plan. A round that drafted nothing becomes a "forced"
    round: only those tokens (a drafter with kinds of round does not run its model)."""
    n_forced = torch.tensor(counts, device=forced.device)
    if plan is None:
        plan = DraftPlan(Offer(len(counts), forced.device), "forced", torch.zeros_like(n_forced), 0, reason)
    plan.forced, plan.n_forced, plan.width = forced, n_forced, max(plan.width, forced.shape[1])
    return plan


def likeliest(chance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a round sized row by row from ``chance`` ``[B, k]`` (P(draft j of row b is accepted), falling with j):
    ``(expected accepted drafts of the m likeliest drafts of the batch, m = 1..B*k; each draft's rank [B, k])``. The
    round verifying m drafts gives row b ``(rank[b] < m).sum()`` of them: its first ones."""
    top = chance.flatten().sort(descending=True, stable=True)
    rank = torch.empty_like(top.indices).scatter_(0, top.indices, torch.arange(chance.numel(), device=chance.device))
    return top.values.cumsum(0), rank.view_as(chance)


def dearer(chance: torch.Tensor, budget: DraftBudget) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``likeliest`` where drafts cost more in some rows than in others (``budget.context``): the drafts ranked by
    their chance per plain step (a row's first draft's price, ``verify[1] - verify[0]``, plus its row's share), so
    that of two equally likely drafts the one in the shorter row is verified first; ``(expected accepted drafts of the
    m best, what their rows add to the round's price, each draft's rank)``, m = 1..B*k. A row's drafts keep their
    order (one divisor a row)."""
    b, k = chance.shape
    per_draft = budget.context[1]
    unit = budget.verify[1] - budget.verify[0] if len(budget.verify) > 1 else 1.0
    price = (unit + per_draft).clamp(min=unit / 10)  # a draft always costs something
    _, rank = likeliest(chance / price[:, None])
    order = torch.empty_like(rank.flatten()).scatter_(0, rank.flatten(), torch.arange(b * k, device=chance.device))
    return chance.flatten()[order].cumsum(0), per_draft.repeat_interleave(k)[order].cumsum(0), rank


def cheapest(tokens: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """The one pricing routine: the size (an index of ``tokens`` ``[n]``, the expected tokens of each, and ``cost``
    ``[n]``, its cost in plain steps) with the most tokens per plain step, the first (a plain step) counted ``MARGIN``
    more; the first of equals (the smallest)."""
    rate = tokens / cost
    return torch.cat([rate[:1] * (1 + MARGIN), rate[1:]]).argmax()


class Planner:
    """Each round's ``DraftPlan`` from a drafter's ``Offer`` and the round's ``DraftBudget``, and the acceptance it
    plans with (``copies``: per match length and index; ``head``: a head's first drafts), learned from every round."""

    def __init__(self):
        self.copies, self.head = Copies(), HeadRate()

    def plan(self, offer: Offer, budget: DraftBudget) -> DraftPlan:
        """A round of at most ``budget.k`` drafts a row. Without candidates, or without costs (``budget.sized``
        false: a fixed length) or under sampling: every candidate, else k (a head round of k). Otherwise each kind of
        round and size is worth its expected tokens over its cost in plain steps (``round_costs``): a copy round
        verifies only the copies (rows without a match draft nothing; a head does not run), a head round runs the
        head for j steps (it drafts on after the copies of the rows that copy first: those whose match length's first
        copy is accepted more often than the head's first draft). Where rows are sized one by one
        (``budget.per_row``), a copy round verifies the m likeliest copies of the batch (each row's first ones), m =
        0..rows x k, priced by the drafts it verifies in all, and a head round of width j verifies rows x j drafts.
        One host read where sizes are priced or candidates counted."""
        k, b, reason = budget.k, offer.rows, budget.reason
        if offer.candidates is None:
            return DraftPlan(offer, None, torch.full((b,), k, dtype=torch.long, device=offer.device), k, reason)
        match, count = offer.match, offer.count
        dev, heads = match.device, "head" in offer.kinds
        col = torch.arange(k, device=dev)[None, :]
        chance = self.copies.survival(k, dev, offer.keys)[match] * (col < count[:, None])  # [B, k]
        use = None
        if heads:
            head = self.head.survival(k, dev)  # [k]
            use = (count > 0) & (chance[:, 0] > head[0])
        if not budget.sized or offer.sampling:
            if heads:
                return DraftPlan(offer, "head", torch.full_like(count, k), k, reason, use, most=k)
            return DraftPlan(offer, None, count, int(count.max()) if b else 0, reason)
        per = b if budget.per_row else 1  # drafts verified per unit of a head round's width
        pad, context, added = torch.nn.functional.pad, budget.context, None
        price = self.round_costs(budget, dev, offer.waiting, per, offer.left)  # [copy / head, m = 0..k*per]
        if per > 1 and context is not None:  # the m copies worth most per plain step, each at its row's price
            gain, added, rank = dearer(budget.weigh(chance), budget)
        elif per > 1:  # a copy round's m copies of the batch worth most: E(m), m = 0..b*k
            gain, rank = likeliest(budget.weigh(chance))  # each row's expected tokens at its worth
        else:  # one width for the batch: E(j), j = 0..k, from each column's expected accepted drafts
            gain = chance.sum(0).cumsum(0)
        if context is not None:  # what the rows' cached tokens add: copies at their rows', a width j a row elsewhere
            across = torch.arange(k * per + 1, device=dev, dtype=torch.float64) / per * context[1].sum()
            price = price + context[0] + torch.stack([across if added is None else pad(added, (1, 0)), across])
        tokens, cost = [pad(gain, (1, 0))], [price[0]]
        if heads:  # then a head round of j steps, j = 0..k
            last = chance.gather(1, (count - 1).clamp(min=0)[:, None])
            mixed = torch.where(col < count[:, None], chance, last * head[(col - count[:, None]).clamp(min=0)])
            mixed = torch.where(use[:, None], mixed, head[None, :])
            mixed = budget.weigh(mixed) if per > 1 else mixed
            tokens.append(pad(mixed.sum(0).cumsum(0), (1, 0)))
            cost.append(price[1, ::per])
        best = cheapest(b + torch.cat(tokens), torch.cat(cost))  # the first of equals: a plain step
        copy_round = best <= k * per
        n = (rank < best).sum(1) if per > 1 else count.clamp(max=best)  # a row's chances fall with j: its first ones
        n = torch.where(copy_round, n, 0)
        best, width = torch.stack([best, n.max()]).tolist()  # the round's host read
        if best <= k * per:
            return DraftPlan(offer, "copy" if heads else None, n, width, reason, use)
        width = best - k * per - 1
        deep = DEPTH_CONFIDENCE is not None
        most = k if deep and (b == 1 or budget.per_row) else width
        return DraftPlan(offer, "head", torch.full_like(count, width), width, reason, use,
                         DEPTH_CONFIDENCE if deep else None, most, deep and budget.per_row)

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

    def learn(self, plan: DraftPlan, proposal, accepted: torch.Tensor, target) -> None:
        """What the round's drafts did (device only): the copies' acceptance per match length and index, and in a
        round that ran the head both first drafts, whichever was drafted (the target's first token is known). Rows
        that drafted forced tokens teach nothing: those are no copies."""
        offer, width = plan.offer, proposal.drafts.shape[1]
        if offer.match is None or not width:
            return
        if plan.kind != "head":
            offered, right = proposal.n_drafts, accepted
            if plan.n_forced is not None:
                offered, right = offered.masked_fill(plan.n_forced > 0, 0), right.masked_fill(plan.n_forced > 0, 0)
            self.copies.learn(offer.match, offered, width, right, offer.keys)
            return
        token = target.tokens()[:, 0]
        count, use = offer.count, plan.use
        weak = (count > 0) & ~use  # copies not drafted: their first one scored all the same
        offered = torch.where(use, count.clamp(max=width), weak.long())
        right = torch.where(use, torch.minimum(accepted, offered), (weak & (offer.candidates[:, 0] == token)).long())
        self.copies.learn(offer.match, offered, width, right, offer.keys)
        self.head.learn(proposal.first, token)


class Plans:
    """What every policy shares: the planner, made on first use, that turns a drafter's offer into the round's plan
    within the policy's budget and learns from what the round's drafts did."""

    @property
    def planner(self) -> Planner:
        if "_planner" not in self.__dict__:
            self._planner = Planner()
        return self._planner

    def plan(self, offer: Offer, budget: DraftBudget) -> DraftPlan:
        return self.planner.plan(offer, budget)

    def learn(self, plan: DraftPlan | None, proposal, accepted: torch.Tensor, target) -> None:
        if plan is not None:
            self.planner.learn(plan, proposal, accepted, target)
