"""The adaptive speculation length: each round's k from measured costs and estimated acceptance (goodput)."""

from __future__ import annotations

import math

import torch

from .row_values import FIXED_SHARE, expected_tokens


class AdaptiveLength:
    """Choose k in 0..K to maximise the batch's expected tokens per second (goodput, as in SmartSpec).

    - Expected tokens: each row's acceptance rate ``alpha`` is estimated from its own recent rounds (drafts
      accepted, and rounds that stopped short of the drafts offered: a row that got no proposal counts as a
      rejection; each older round weighs ``decay`` less), blended with the long-run rate of all rows
      (``prior_weight`` pseudo-rounds; the mean over drafting rounds, then a moving average with
      ``rate_smoothing``), so new rows start from the drafter's rate, and a row's few unlucky rounds do not stop
      a drafter that pays on average (its rounds without drafting would not bring fresh evidence).
    - Cost: a round of ``B`` rows costs ``T0(B)`` seconds if it drafts nothing, else ``T0(B) + F(B) + k * D(B)``:
      ``T0`` from rounds that drafted nothing (a moving average), ``F`` (what drafting costs at all: a draft model's
      catch-up forward, prompt lookup's matching) and ``D`` (each token drafted and verified) from a line fitted to
      the other rounds' extra seconds against the tokens they verified, older rounds fading; per batch size. A batch
      size runs a plain round before its first drafting round (its own ``T0``: a plain step of more or fewer rows
      would misprice every width against it); its ``F``, ``D`` and width costs may come from the nearest size seen
      within a third. A drafter that proposes fewer tokens than offered (prompt lookup) is charged for what it
      verifies on average (``fill``: verified / offered, a moving average). The first rounds measure: k = 0, then k = 1.
    - A row's rate only updates when it drafts: after ``probe_every`` rounds in a row without drafting, one round
      drafts a single token (the interval doubles, up to 8x, while such probes change nothing); after twice as many
      rounds in a row that drafted, one round drafts nothing (the cost of a plain step grows with the context). A
      drafter that sizes its own rounds and verified nothing for ``probe_every`` rounds in a row is asked every
      ``look_every``-th round only (the others are plain steps without its work), until a round verifies drafts.
    - With temperature > 0 the length stays K: the tokens a seed yields depend on how many were drafted, and a length
      chosen from timings would make seeded outputs depend on the machine's speed.
    """

    name = "adaptive"

    def __init__(self, prior_weight: float = 3.0, probe_every: int = 8, smoothing: float = 0.3,
                 initial_rate: float = 0.5, costs: tuple | None = None, decay: float = 0.7,
                 width_smoothing: float = 0.1, rate_smoothing: float = 0.05, stale: int = 200,
                 explore: float = 0.2, look_every: int = 4):
        """``costs``: ``(T0, D)`` or ``(T0, F, D)`` in seconds, used for every batch size instead of measured ones
        (tests, or a machine whose costs are known). ``stale``: rounds after which a width's measured cost is
        forgotten (the next round of that width measures it afresh). ``explore``: a width's cost measured n times
        is taken as ``(1 - explore / n)`` times its mean, so that one round slowed by the machine does not price a
        width out of reach before it was measured again; the discount fades as 1/n (as 1/sqrt(n) it kept widths that
        break even a few percent too cheap for good)."""
        self.prior_weight, self.probe_every, self.smoothing = prior_weight, probe_every, smoothing
        self.width_smoothing = width_smoothing  # per-width costs: relative, so they may average longer
        self.costs = None if costs is None else (costs[0], 0.0, costs[1]) if len(costs) == 2 else tuple(costs)
        self.decay = decay
        self.rate = initial_rate  # long-run acceptance rate of all rows (the prior for each row)
        self.rate_smoothing, self.drafting_rounds = rate_smoothing, 0
        self.t0: dict[int, float] = {}  # rows -> seconds of a round that drafts nothing
        # rows -> kind of round -> extra seconds of a drafting round against the tokens it verified
        self.lines: dict[int, dict] = {}
        self.expected: list[float] | None = None  # mean tokens per row for k = 0..K, from the last round
        self.idle = self.busy = 0  # rounds in a row that drafted nothing / that drafted
        self.interval, self.probed = probe_every, False  # rounds between probes (doubling while probes find nothing)
        self.seen = 0
        self.fill = 1.0  # tokens verified per token offered (prompt lookup often proposes fewer, or none)
        # rows -> (kind of round, block width) -> its cost: a drafting round's seconds over the plain step's at the
        # time (the machine's speed drifts; a width seldom run keeps its cost relative to the step, not its seconds);
        # forgotten after ``stale`` rounds without one (a width measured in a slow minute and not chosen since would
        # keep its cost for ever)
        self.widths: dict[int, dict[tuple, _Width]] = {}
        # rows -> kind of round -> the cost of one unit of its extra work (a head's catch-up: each pair it caches) over
        # a round of its base kind and width, in plain steps (``observe``'s ``work`` and ``base``)
        self.work: dict[int, dict] = {}
        self.stale, self.explore = stale, explore
        # a drafter sizing its own rounds: rounds in a row that verified nothing, how many make a probe (doubling up to
        # 8x while only probes draft), and whether the round being run is a probe
        self.dry, self.dry_interval, self.probing = 0, probe_every, False
        # rounds in a row that verified nothing (probes included); past ``probe_every`` such rounds the drafter is asked
        # every ``look_every``-th round only
        self.unverified, self.look_every = 0, look_every

    # ---------------------------------------------------------------------------------------------- choose
    def length(self, rows: int, k_max: int, sampling: bool = False) -> int:
        if sampling or k_max == 0:
            return k_max
        t0, f, d = self.cost(rows)
        if t0 is None:
            return 0
        if d is None:
            return 1
        best = max(range(k_max + 1), key=lambda k: (self.tokens(k) / (t0 + (f + k * self.fill * d if k else 0.0)), -k))
        if self.probed:  # the last round was a probe: if it changed nothing, wait twice as long for the next one
            self.probed = False
            self.interval = min(2 * self.interval, 8 * self.probe_every) if best == 0 else self.probe_every
        if best == 0:
            self.idle, self.busy = self.idle + 1, 0
            if self.idle >= self.interval:  # refresh the acceptance estimates
                self.idle, self.probed = 0, True
                return 1
        else:
            self.idle, self.busy = 0, self.busy + 1
            if self.busy >= 2 * self.probe_every:  # refresh the cost of a plain step (it grows with the context)
                self.busy = 0
                return 0
        return best

    def drafter_length(self, rows: int, k_max: int, kinds=None, step: int = 1) -> tuple[int, list | dict | None]:
        """For a drafter that sizes its own proposals from what it knows per row (prompt lookup's match lengths):
        K, and what a round verifying j = 0..K drafts per row costs, in plain steps: measured per block width
        (rounds of about this many rows, older rounds fading), else from the fitted line ``T0 + F + j * D``, else
        None (the drafter's own prior); a width more than ``step`` drafts wider than the widest measured, ``inf``
        (not tried before the narrower ones priced it). A width's measured cost is the moving average of its rounds'
        seconds over the plain step's cost when each ran, so the machine's drifting speed does not skew widths run at
        different times; a width not run at this batch size yet takes the nearest size's within a third. None
        instead of the list before a plain step was measured. The plain-step measurements stay: first a round that
        drafts nothing, and again after ``2 * probe_every`` rounds in a row that drafted (every round that verified
        nothing measures one, and the count starts again). After ``probe_every`` rounds in a row that verified
        nothing, one round is priced by the drafter's own prior (None) up to half a draft a row (``step // 2``
        drafts, at least 1; per kind, with kinds) and measured: one slow round could otherwise price every size out
        of reach for ``stale`` rounds, nothing drafting to correct it, and the prior's own full sizes cost more than
        it said; while probes change nothing the wait doubles, up to 8x. ``step``: how much wider than the widest
        measured a round may be priced from the line (1: one draft more per row; a drafter sizing each row of a
        packed round, whose "width" is 1 + the drafts verified in all: the rows, one draft more each). A drafter whose
        rounds come in kinds that cost differently (``kinds``: the feature-reading head's rounds that run the head,
        those that only copy, those that catch up on a long wait) gets a dict: per kind, the same from that kind's own
        rounds and line (a kind's line only prices its own widths: one catch-up round of a head on a long prompt, 3
        plain steps, would otherwise price every width of every kind out of reach for good), None where neither says
        (its own fallbacks are the drafter's to choose); and under ``"work"``, per kind, what one unit of a round's
        extra work costs (``observe``), or None."""
        if self.cost(rows)[0] is None:
            return 0, None
        self.busy += 1
        if self.busy >= 2 * self.probe_every:
            self.busy = 0
            return 0, None
        if self.dry >= self.dry_interval:  # nothing verified for a while: one small round on the drafter's own prior
            self.dry, self.dry_interval, self.probing = 0, min(2 * self.dry_interval, 8 * self.probe_every), True
            small = max(1, step // 2)
            prior = [1.0] + [None if j <= small else math.inf for j in range(1, k_max + 1)]
            return k_max, {**dict.fromkeys(kinds, prior), "work": dict.fromkeys(kinds, None)} if kinds else prior
        if self.unverified >= self.probe_every and self.unverified % self.look_every:
            return 0, None  # nothing verified for a while: a plain step, without asking the drafter
        if not kinds:
            return k_max, self._explored(rows, None, k_max, step)
        costs = {kind: self._explored(rows, kind, k_max, step) for kind in kinds}
        costs["work"] = {kind: self._per_unit(rows, kind) for kind in kinds}
        return k_max, costs

    def _explored(self, rows: int, kind, k_max: int, step: int = 1) -> list:
        """``[k_max + 1]``: each width's measured cost (``_width``), else from the kind's fitted line, else None; a
        width more than ``step`` drafts wider than the widest measured costs ``inf``. A kind of round is explored from
        narrow to wide, each width priced from the narrower ones' line before it is tried: a first wide round priced
        from a prior is a guess, and can be a dear one (measured: 5 drafts in 8 rows cost 4.4 plain steps on a 2-core
        CPU where the prior said 2). Rounds sized row by row (``step`` > 1) are priced from the line alone, the sizes
        measured only bounding the exploration: each of their up to K x rows sizes runs a few times at most, too few
        for its own mean (priced so, rounds drafted at a loss)."""
        t0, f, d = self.cost(rows, kind)
        line = [1.0 if j == 0 else None if d is None else 1.0 + (f + j * d) / t0 for j in range(k_max + 1)]
        # the widest measured at a batch size near enough: one pass over the table, not one per width (a round
        # sized row by row at 8 rows prices 65 sizes of each kind)
        widest = max((w - 1 for b, table in self.widths.items() if _near(b, rows)
                      for (of, w), entry in table.items() if of == kind and w <= k_max + 1 and self._fresh(entry)),
                     default=0)
        measured = [self._width(rows, (kind, j + 1), None) if j and step == 1 else None for j in range(k_max + 1)]
        return [c if c is not None else fit if j <= widest + step else math.inf
                for j, (c, fit) in enumerate(zip(measured, line))]

    def _width(self, rows: int, key: tuple, default):
        """A width's measured cost (in plain steps) at ``rows`` rows, else at the nearest batch size near enough
        (``_near``) that ran it, less the exploration discount of its few rounds; measurements older than ``stale``
        rounds do not count."""
        found = self._found(self.widths, key, rows)
        return default if found is None else found.cost * (1 - self.explore / found.n)

    def _per_unit(self, rows: int, kind):
        """A kind's measured cost per unit of work at ``rows`` rows (or the nearest size near enough), or None."""
        found = self._found(self.work, kind, rows)
        return None if found is None else found.cost

    def _base_cost(self, rows: int, kind, width: int):
        """What a round of ``kind`` and ``width`` costs in plain steps (measured, else that kind's line), or None."""
        found = self._found(self.widths, (kind, width), rows)
        if found is not None:
            return found.cost
        t0, f, d = self.cost(rows, kind)
        return None if d is None else 1.0 + (f + (width - 1) * d) / t0

    def _found(self, table: dict, key, rows: int):
        """``table[b][key]`` for the batch size b nearest ``rows`` (``_near``) whose entry is fresh, or None."""
        return _nearest({b: t[key] for b, t in table.items() if key in t and self._fresh(t[key])}, rows)

    def _add(self, table: dict, rows: int, key, value: float) -> None:
        """Feed ``value`` to ``table[rows][key]``, started afresh when it was never fed or is stale."""
        entry = table.setdefault(rows, {}).get(key)
        if entry is None or not self._fresh(entry):
            entry = table[rows][key] = _Width()
        entry.add(value, self.width_smoothing, self.seen)

    def _fresh(self, entry) -> bool:
        """A width's cost or a line, fed within the last ``stale`` rounds."""
        return self.seen - entry.at <= self.stale

    def cost(self, rows: int, kind=None) -> tuple:
        """``(T0, F, D)`` for ``rows`` rows: a round drafting k costs ``T0`` seconds if k = 0, else
        ``T0 + F + k * D`` (``F``: what drafting costs at all, e.g. a draft model's catch-up forward or prompt
        lookup's matching; ``D``: each drafted token, drafting and verifying it), from rounds of that ``kind``. Nones
        until measured; a line not fed for ``stale`` rounds is forgotten like a width."""
        if self.costs is not None:
            return self.costs
        fresh = {b: kinds[kind] for b, kinds in self.lines.items() if kind in kinds and self._fresh(kinds[kind])}
        t0, line = self.t0.get(rows), _nearest(fresh, rows)
        return (t0, *(line.solve() if line is not None else (None, None)))

    def fixed_share(self, rows: int) -> float:
        """The share of a step of ``rows`` rows that does not grow with its rows: a line through the plain steps
        measured at ``rows`` and at the smallest size measured that is at most half of it, else ``FIXED_SHARE``
        (measured on a 2-core CPU at 8 rows: ~0.7 over the built-in prompts, ~0.54 over Spec-Bench 8's)."""
        t, small = self.t0.get(rows), [b for b in self.t0 if 2 * b <= rows]
        if t is None or not small:
            return FIXED_SHARE
        r = min(small)
        per_row = (t - self.t0[r]) / (rows - r)
        return min(max(1 - per_row * rows / t, 0.0), 1.0)

    def tokens(self, k: int) -> float:
        """Expected tokens per row for a round drafting k (from the last estimates, else the running rate)."""
        if self.expected is not None and k < len(self.expected):
            return self.expected[k]
        a = min(self.rate, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    # ---------------------------------------------------------------------------------------------- learn
    def record(self, seqs, accepted, k: int) -> None:
        """After a round that offered k drafts: each row's evidence, older rounds weighing ``decay`` less per round
        (prompt lookup accepts in bursts: while a row copies, its recent rounds say more than its history)."""
        if k:
            new = torch.stack([accepted, accepted < k], 1)
            seqs.evidence.mul_(self.decay).add_(new)

    def estimates(self, seqs, k_max: int) -> torch.Tensor:
        """[k_max + 1 mean expected tokens per row, accepted drafts, short rounds] of the running rows."""
        hits, misses = seqs.evidence[:, 0], seqs.evidence[:, 1]
        w = self.prior_weight
        alpha = (hits + w * self.rate) / (hits + misses + w)
        return torch.cat([expected_tokens(alpha, k_max).mean(0), torch.stack([hits.sum(), misses.sum()])])

    def observe(self, rows: int, k: int, width: int, seconds: float, values, kind=None, work=0, base=None) -> None:
        """``work``: units of extra work the round did on top of a round of kind ``base`` and its width (a head's
        catch-up: the pairs it cached); its cost per unit is learned against that base round's cost."""
        if values is not None:
            *expected, hits, misses = values
            self.expected = expected
            if k and hits + misses > 0:  # the drafter's long-run rate: the mean of drafting rounds, then an EMA
                self.drafting_rounds += 1
                step = max(1 / self.drafting_rounds, self.rate_smoothing)
                self.rate += step * ((hits + 1) / (hits + misses + 2) - self.rate)
        self.seen += 1
        drafted = width - 1  # what the round actually verified (a drafter may propose less than k)
        if drafted and not self.probing:  # drafting resumed: the next probe waits the shortest time again
            self.dry_interval = self.probe_every
        self.dry, self.probing = 0 if drafted else self.dry + 1, False
        self.unverified = 0 if drafted else self.unverified + 1
        if self.seen == 1 or self.costs is not None:  # the first round pays one-time costs (kernels, buffers)
            return
        if drafted == 0:  # a plain step (k = 0, or a drafter that sized its round to nothing)
            _ema(self.t0, rows, seconds, self.smoothing)
            self.busy = 0  # measured: the next plain step the policy asks for waits its whole interval again
        else:
            self.fill += self.smoothing * (drafted / k - self.fill)
            if (t0 := self.t0.get(rows)) is not None:
                self._add(self.widths, rows, (kind, width), seconds / t0)
                if work and base is not None and (ref := self._base_cost(rows, base, width)) is not None:
                    self._add(self.work, rows, kind, max(seconds / t0 - ref, 0.0) / work)
                self.lines.setdefault(rows, {}).setdefault(kind, _Line(1 - self.smoothing)).add(
                    drafted, seconds - t0, self.seen)


class _Width:
    """A block width's cost in plain steps: the mean of its first rounds, then a moving average (``smoothing``);
    ``n`` rounds in it, the latest in round ``at``."""

    def __init__(self):
        self.cost, self.n, self.at = 0.0, 0, 0

    def add(self, value: float, smoothing: float, at: int) -> None:
        self.n, self.at = self.n + 1, at
        self.cost += max(1 / self.n, smoothing) * (value - self.cost)


class _Line:
    """A least-squares line ``y = F + D * x`` over observations that fade by ``keep`` each (F, D >= 0)."""

    def __init__(self, keep: float):
        self.keep, self.sums = keep, [0.0] * 5  # weights, x, x^2, y, x*y
        self.at = 0  # the round of its latest observation

    def add(self, x: float, y: float, at: int) -> None:
        self.sums = [self.keep * s + v for s, v in zip(self.sums, (1.0, x, x * x, y, x * y))]
        self.at = at

    def solve(self) -> tuple[float, float]:
        n, sx, sxx, sy, sxy = self.sums
        det = n * sxx - sx * sx
        if det > 1e-9 * n * n:
            d = max((n * sxy - sx * sy) / det, 0.0)
        else:  # one width seen so far: all of it per token (or, with nothing drafted, all of it fixed)
            return (max(sy / n, 0.0), 0.0) if sx == 0 else (0.0, max(sy / sx, 0.0))
        return max((sy - d * sx) / n, 0.0), d


def _ema(table: dict, key: int, value: float, smoothing: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else (1 - smoothing) * old + smoothing * value


def _near(a: int, b: int) -> bool:
    """Batch sizes close enough to share drafting costs (within a third of the larger). A CPU verifying 2 tokens per
    row costs ~1.1 plain steps at 2 rows, where the weights' reads dominate, and 1.9 at 8 rows, where the arithmetic
    does: a cost borrowed from far off would stop drafting where it pays, or start it where it does not."""
    return 4 * min(a, b) >= 3 * max(a, b)


def _nearest(table: dict, rows: int):
    near = [b for b in table if _near(b, rows)]
    return table[min(near, key=lambda b: (abs(b - rows), -b))] if near else None
