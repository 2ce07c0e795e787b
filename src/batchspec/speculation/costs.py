"""What a round costs, measured once: the target's forward of ``rows`` rows x ``w`` new tokens per row, and the
drafter's own forwards, timed on a synthetic batch (random keys and values: a forward's cost does not depend on them),
per machine, model, dtype, device and thread count, and cached as JSON under ``$BATCHSPEC_CACHE/profiles``.

Everything the speculation decision prices is in *plain steps*: the seconds of a round that drafts nothing (one new
token per row) at the same number of rows. Ratios travel well: a machine that drifts by 20% within minutes, as a
shared CPU does, slows plain and speculative rounds alike, and the decision compares rounds of one moment.

Why measured up front and not learned from live rounds: a live round's wall time mixes in whatever else the machine
did meanwhile (a server's HTTP thread, a prefill, another process), a width that is seldom run keeps one unlucky
measurement for a long time, and in a server the batch size changes every round, so a table learned per batch size
stays sparse. A profile takes a few seconds at first use and is read from the cache afterwards (``batchspec
profile`` shows it).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model import kernels, kv
from ..model.loading import cache_base, context_length

PROFILE_VERSION = 3  # bump when what is measured changes: older cached profiles are measured again
WIDTHS = (1, 2, 3, 4, 6)  # new tokens per row measured (a verification of K = 5 drafts is 6 wide)
CONTEXT = 256  # cached tokens per row in the synthetic batch: a typical chat prompt plus some answer
# cached tokens per row of a second synthetic batch: what attention costs per cached token, for a plain step and per
# verified draft, is the difference (``CostModel.context``). On a 2-core CPU a draft in a row of 1,024 tokens costs
# 1.4-1.6x one at 256 (0.5 us a token per layer stack), and rows that copy are the long ones (summaries, RAG)
LONG = 1024
LONG_BYTES = 1 << 29  # the most KV bytes the second batch takes; where more rows would, fewer tokens a row
# timed forwards per point after a warm-up: a width's cost is the median over repetitions of its ratio to the plain
# forward timed beside it, times the fastest plain forward (the machine's noise only ever adds time, and a drift of it
# slows forwards timed together alike). Fastest of 3 per width on its own put a 4-row verification of one draft at 1.41
# and 1.70 plain steps in two profiles minutes apart, and drafting at 8 rows went from 0.95x plain to never chosen
REPEATS = 5
PAIRS = 64  # tokens per row of the drafter's catch-up forward that prices one cached pair
# what a round that drafts costs beyond the forwards the profile times: the drafter's and the engine's bookkeeping
# (matching, planning, a longer acceptance and alignment), and per drafting forward its own (the slots' positions,
# the drafts' gathers, the head's confidence). Measured with the default head at batch 1 on a 2-core CPU, rounds of
# 1 and 3 drafts every round: 1.0 and 2.1 ms over their priced forwards (plain steps 7.9 and 6.2 ms), so ~0.45 ms a
# round and ~0.55 ms a forward; unpriced, such rounds were chosen where they cost more than they brought
DRAFT_ROUND_SECONDS = 0.00045
DRAFT_FORWARD_SECONDS = 0.00055


def row_points(batch_size: int) -> list[int]:
    """Batch sizes measured: powers of two up to ``batch_size``, and ``batch_size`` itself."""
    points = [1 << i for i in range(batch_size.bit_length()) if 1 << i <= batch_size]
    return sorted(set(points + [batch_size]))


@dataclass
class Profile:
    """Seconds of forwards on one machine. ``target[rows][i]``: the target's forward of ``rows`` x ``WIDTHS[i]`` new
    tokens over ``CONTEXT`` cached tokens a row; ``long[rows]``: ``(context, seconds)``, the narrowest and the widest
    of them over a longer context (none: rounds priced at ``CONTEXT`` whatever their rows hold); ``step[rows]``: one
    drafting forward of the drafter's model (one token per row); ``pair``: what the drafter's model spends per row and
    token of a catch-up forward (seconds; 0 for model-free drafters)."""

    target: dict[int, list[float]]
    step: dict[int, float] = field(default_factory=dict)
    pair: float = 0.0
    key: str = ""
    long: dict[int, tuple[int, list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": PROFILE_VERSION, "key": self.key, "widths": list(WIDTHS), "target": self.target,
                "long": self.long, "step": self.step, "pair": self.pair}

    @classmethod
    def from_json(cls, d: dict) -> "Profile | None":
        if d.get("version") != PROFILE_VERSION or d.get("widths") != list(WIDTHS):
            return None
        return cls({int(r): v for r, v in d["target"].items()}, {int(r): v for r, v in d["step"].items()},
                   float(d["pair"]), d.get("key", ""), {int(r): (int(c), v) for r, (c, v) in d["long"].items()})


class CostModel:
    """Costs in plain steps from a ``Profile``; batch sizes between measured ones are interpolated linearly (a
    forward's seconds grow about linearly with its rows), beyond the largest extrapolated from the last two."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.rows = sorted(profile.target)
        self._verifies: dict[tuple[int, int, bool], list[float]] = {}  # (rows, most, per_row) -> ``verifies``
        self._attention: dict[int, tuple[float, float]] = {}  # rows -> ``context``'s slopes

    def verifies(self, rows: int, most: int, per_row: bool) -> list[float]:
        """``[verify(rows, m, per_row) + overhead if m] for m = 0..most``: a round's price list, the same for the same
        arguments (a profile does not change), so made once (pricing it took ~0.3 ms of every round at 8 rows)."""
        key = (rows, most, per_row)
        if key not in self._verifies:
            extra = self.overhead(rows)
            self._verifies[key] = [self.verify(rows, m, per_row) + (extra if m else 0.0) for m in range(most + 1)]
        return self._verifies[key]

    def seconds(self, rows: int, tokens: float) -> float:
        """A target forward of ``rows`` rows and ``tokens`` new tokens in all (at least ``rows``)."""
        width = max(tokens / rows, 1.0)
        return self._in_rows(rows, lambda r: _in_widths(self.profile.target[r], width))

    def plain(self, rows: int) -> float:
        return self.seconds(rows, rows)

    def verify(self, rows: int, drafts: int, per_row: bool) -> float:
        """A round verifying ``drafts`` drafts, in plain steps: per row (the block is ``drafts + 1`` wide for every
        row) or, ``per_row``, in all (a runner that computes only each row's real tokens: ``rows + drafts`` tokens)."""
        tokens = rows + drafts if per_row else rows * (drafts + 1)
        return self.seconds(rows, tokens) / self.plain(rows)

    def context(self, rows: int, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a round over rows of ``lengths`` ``[B]`` cached tokens costs beyond its price at ``CONTEXT`` a row,
        in plain steps (at ``CONTEXT``): ``(base, per_draft)``, base added to a round of any size (a plain step's
        attention over the rows' tokens), ``per_draft[b]`` to each draft of row b (a verified token's attention over
        its row's). From the profile's two contexts: per row and cached token, a plain step's slope ``a`` and the
        slope of one more token a row ``d``; linear in between and beyond (a row shorter than ``CONTEXT`` costs
        less). None without a long measurement. Device tensors: no host read."""
        points = sorted(self.profile.long)
        if not points:
            return None
        if rows not in self._attention:  # (a profile does not change)
            self._attention[rows] = tuple(_interp(points, lambda r: self._slopes(r)[i], rows) for i in (0, 1))
        a, d = self._attention[rows]
        more = (lengths.to(torch.float64) - CONTEXT) / self.plain(rows)
        return (more * a).sum(), more * d

    def _slopes(self, rows: int) -> tuple[float, float]:
        """Seconds per row and cached token past ``CONTEXT``: of a plain step, and of each more new token of a row
        (from the widest measured), never below 0."""
        context, seconds = self.profile.long[rows]
        base, span = self.profile.target[rows], (context - CONTEXT) * rows
        plain = (seconds[0] - base[0]) / span
        wider = (seconds[-1] - base[-1]) / span
        return max(plain, 0.0), max((wider - plain) / (WIDTHS[-1] - 1), 0.0)

    def overhead(self, rows: int) -> float:
        """What a round that drafts costs beyond its forwards (``DRAFT_ROUND_SECONDS``), in plain steps."""
        return DRAFT_ROUND_SECONDS / self.plain(rows)

    def step(self, rows: int) -> float:
        """One drafting forward of the drafter's model and its bookkeeping (``DRAFT_FORWARD_SECONDS``), in plain
        steps (0 without one)."""
        if not self.profile.step:
            return 0.0
        points = self.profile.step
        return (_interp(sorted(points), lambda r: points[r], rows) + DRAFT_FORWARD_SECONDS) / self.plain(rows)

    def pair(self, rows: int) -> float:
        """Caching one token (a pair of the head) of every row in the drafter's model, in plain steps."""
        return self.profile.pair * rows / self.plain(rows)

    def fixed_share(self, rows: int) -> float:
        """The share of a plain step of ``rows`` rows that does not grow with its rows (``row_values``): from the
        plain steps at ``rows`` and at half as many."""
        if rows < 2:
            return 1.0
        half = rows // 2
        t, t_half = self.plain(rows), self.plain(half)
        per_row = (t - t_half) / (rows - half)
        return min(max(1.0 - per_row * rows / t, 0.0), 1.0)

    def _in_rows(self, rows: int, at) -> float:
        return _interp(self.rows, at, rows)


def _interp(points: list[int], at, x: float) -> float:
    """``at(x)`` linearly interpolated between measured ``points`` (extrapolated past the last two)."""
    if len(points) == 1 or x <= points[0]:
        return at(points[0])
    hi = next((p for p in points if p >= x), points[-1])
    lo = points[points.index(hi) - 1]
    a, b = at(lo), at(hi)
    return a + (b - a) * (x - lo) / (hi - lo)


def _in_widths(seconds: list[float], width: float) -> float:
    """Seconds at ``width`` new tokens per row from the measured ``WIDTHS`` (linear between, and past the widest)."""
    return _interp(list(WIDTHS), lambda w: seconds[WIDTHS.index(w)], width)


# ------------------------------------------------------------------------------------------------- measuring


def synthetic_state(runner, rows: int, context: int):
    """A ``SlotState`` of ``rows`` rows with ``context`` cached tokens each (random keys and values, all visible)."""
    from ..batch import SlotState

    cfg = runner.model.config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dev, dtype = runner.device, runner.model.dtype
    cache = kv.new_cache(runner.model)
    like = torch.zeros((rows, heads, 1, dim), dtype=dtype, device=dev)
    for layer in cache.layers:
        k, v = layer.fresh(like, like, rows, context)
        k.normal_()
        v.normal_()
    valid = torch.ones((rows, context), dtype=torch.bool, device=dev)
    positions = torch.arange(context, device=dev).expand(rows, -1).contiguous()
    tokens = torch.zeros((rows, context), dtype=torch.long, device=dev)
    return SlotState(runner, cache, valid, tokens, positions)


def _rewind(state, width: int) -> None:
    """Forget the slots past ``width`` (the timed forward's)."""
    state.width = width
    for layer in state.cache.layers:
        layer.advance(width)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def time_forwards(state, widths, repeats: int = REPEATS, hidden: bool = False, inputs=None,
                  keep: int = 0) -> list[float]:
    """Seconds of a forward of each of ``widths`` new tokens per row appended to ``state`` (rewound after each): the
    fastest of ``repeats`` for the first width, for each other the median of its ratio to the first timed in the same
    repetition times that (``_steady``), the widths interleaved within each repetition so that a drift of the machine
    falls on all, after one untimed warm-up of each. ``inputs(ids)``: the input vectors in place of the ids' embeddings,
    computed inside the timed forward (a drafter's own input layer); ``keep``: logits of the last ``keep`` positions
    only (0: all, as a verification needs). Each forward is timed with what its round reads: the target's greedy
    tokens, the drafter's logits."""
    rows, width, dev = len(state), state.width, state.runner.device
    runs = []
    for i in range(repeats + 1):
        run = []
        for j, tokens in enumerate(widths):
            ids = torch.zeros((rows, tokens), dtype=torch.long, device=dev)
            counts = None if inputs is not None else torch.full((rows,), tokens, dtype=torch.long, device=dev)
            _sync(dev)
            t = time.perf_counter()
            embeds = inputs(ids) if inputs is not None else None
            out = state.append(ids, logits_to_keep=keep, hidden=hidden, embeds=embeds, counts=counts)
            # what a round reads: a greedy verification its tokens (a fast argmax where the head has one), a
            # drafter its logits (forwards compute them only when read)
            out.tokens() if inputs is None else out.logits
            _sync(dev)
            run.append(time.perf_counter() - t)
            _rewind(state, width)
        if i:
            runs.append(run)
    return _steady(runs)


def _steady(runs: list[list[float]]) -> list[float]:
    """From repetitions of timings of the same forwards (``runs[i][j]``: forward j in repetition i): the fastest of
    the first, and each other's median ratio to the first in the same repetition times that."""
    first = min(run[0] for run in runs)
    ratios = [sorted(run[j] / run[0] for run in runs) for j in range(len(runs[0]))]
    return [first] + [first * (r[(len(r) - 1) // 2] + r[len(r) // 2]) / 2 for r in ratios[1:]]


def measure(target_runner, batch_size: int, drafter=None, hidden: bool = False, progress=None) -> Profile:
    """Time the target's forwards at ``row_points(batch_size)`` x ``WIDTHS`` (and the drafter's, when it has a
    model: ``drafter.timing()``). Costs never fall with the width or the rows (what the noise left is smoothed so)."""
    points = row_points(batch_size)
    target: dict[int, list[float]] = {}
    long: dict[int, tuple[int, list[float]]] = {}
    for rows in points:
        state = synthetic_state(target_runner, rows, _cached(target_runner, max(WIDTHS)))
        target[rows] = _rising(time_forwards(state, WIDTHS, hidden=hidden))
        state.cache.release()
        context = _long(target_runner, rows)
        if context:
            state = synthetic_state(target_runner, rows, context)
            long[rows] = (context, _rising(time_forwards(state, (WIDTHS[0], WIDTHS[-1]), hidden=hidden)))
            state.cache.release()
        if progress is not None:
            progress.advance()
    for i in range(len(WIDTHS)):  # across rows too
        column = _rising([target[r][i] for r in points])
        for r, v in zip(points, column):
            target[r][i] = v
    step: dict[int, float] = {}
    pair = 0.0
    timing = getattr(drafter, "timing", None)
    if timing is not None:  # a drafter with a model of its own: (its runner, its input layer or None, hidden)
        runner, inputs, want_hidden = timing()
        for rows in points:
            state = synthetic_state(runner, rows, _cached(runner, 1))
            step[rows] = time_forwards(state, (1,), hidden=want_hidden, inputs=inputs, keep=1)[0]
            state.cache.release()
        step = dict(zip(points, _rising([step[r] for r in points])))
        limit = context_length(runner.model)
        pairs = PAIRS if limit is None else max(1, min(PAIRS, limit // 2))
        state = synthetic_state(runner, 1, _cached(runner, pairs))
        pair = time_forwards(state, (pairs,), hidden=want_hidden, inputs=inputs, keep=1)[0] / pairs
        state.cache.release()
    return Profile(target, step, pair, long=long)


def _long(runner, rows: int) -> int:
    """Cached tokens per row of the long synthetic batch of ``rows`` rows: ``LONG``, or fewer where the model's
    positions end sooner or its KV would pass ``LONG_BYTES`` (0 where that leaves none past ``CONTEXT``)."""
    limit = context_length(runner.model)
    context = min(LONG, LONG_BYTES // max(rows * kv.per_token_bytes(runner.model), 1))
    if limit is not None:
        context = min(context, limit - max(WIDTHS))
    return context if context >= 2 * CONTEXT else 0


def _cached(runner, width: int) -> int:
    """Cached tokens per row of a synthetic batch that a forward ``width`` wide appends to: ``CONTEXT``, or fewer
    where the model's positions end sooner (a learned position table has no row past its last)."""
    limit = context_length(runner.model)
    return CONTEXT if limit is None else max(1, min(CONTEXT, limit - width))


def _rising(values: list[float]) -> list[float]:
    """``values`` made non-decreasing (a running maximum)."""
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


# ------------------------------------------------------------------------------------------------- the cache


def profile_key(target_runner, drafter, batch_size: int) -> str:
    """What a profile is valid for: this machine (processor, threads, device), torch, the C kernels' sources (a
    change there changes what a forward costs), the target's and the drafter's shapes and dtypes (not their weights: a
    forward's cost does not depend on them), the batch sizes."""
    def shape(model):
        if model is None:
            return None
        cfg = model.config.get_text_config().to_dict()
        keep = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size")
        return {k: cfg.get(k) for k in keep} | {"dtype": str(model.dtype), "class": type(model).__name__,
                                                "weights": _weight_formats(model)}

    device = target_runner.device
    facts = {
        "version": PROFILE_VERSION, "torch": torch.__version__, "kernels": kernels.source_digest(),
        "machine": platform.machine(), "processor": _processor(), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "target": shape(target_runner.model), "graphs": target_runner.graphs, "packs": target_runner.packed_rows,
        "drafter": shape(getattr(getattr(drafter, "runner", None), "model", None)), "rows": row_points(batch_size),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _weight_formats(model) -> list[str]:
    """The formats the model's weights are kept in (packed weights are read faster: another profile)."""
    return sorted({getattr(getattr(m, "packed", None), "kind", None) or "f32" for m in model.modules()
                   if hasattr(m, "packed") or isinstance(m, (torch.nn.Linear, torch.nn.Embedding))})


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def profile_path(key: str) -> Path:
    return cache_base() / "profiles" / f"{key}.json"


_loaded: dict[str, Profile] = {}  # key -> profile, once per process


def load_or_measure(target_runner, batch_size: int, drafter=None, hidden: bool = False, refresh: bool = False,
                    progress: bool = False) -> Profile:
    """The cached profile for this machine, models and batch sizes, measured (and cached) when there is none."""
    from ..progress import Progress

    key = profile_key(target_runner, drafter, batch_size)
    if not refresh and key in _loaded:
        return _loaded[key]
    path = profile_path(key)
    found = None
    if not refresh and path.is_file():
        try:
            found = Profile.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            found = None
    if found is None:
        with Progress(progress, len(row_points(batch_size)), "profiling the target's forwards") as bar:
            found = measure(target_runner, batch_size, drafter, hidden, bar)
        found.key = key
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(found.to_json(), indent=1))
            tmp.replace(path)
        except OSError:  # a read-only cache: the profile serves this process only
            pass
    _loaded[key] = found
    return found


def describe(model: CostModel, k: int) -> list[list[str]]:
    """Rows of a table: batch size, plain step (ms), verifying 1..k drafts per row in plain steps, the drafter's
    step in plain steps (``batchspec profile``)."""
    out = []
    for rows in model.rows:
        cells = [str(rows), f"{model.plain(rows) * 1e3:.1f}"]
        cells += [f"{model.verify(rows, j, False):.2f}" for j in range(1, k + 1)]
        cells.append(f"{model.step(rows):.3f}" if model.profile.step else "-")
        out.append(cells)
    return out
