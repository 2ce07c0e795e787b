"""Distributional audit: with temperature > 0 there is no single right output, so an engine is checked by the
*distribution* of what it samples. For each engine and prompt, ``samples`` seeded requests are drawn, the first
``n_tokens`` generated tokens are tabulated, and the table is compared with the exact distribution of those tokens
under plain sampling from the target (total-variation distance and a chi-square goodness-of-fit test).

The reference shares no code with batchspec's sampler: it runs the Hugging Face model at batch size 1 (no cache) and
warps the logits with ``transformers``' own ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper``, in that order (Hugging Face's order).

Statistics, per (engine, prompt, prefix length L in 1..n_tokens):

- cells are the L-token prefixes the reference enumerates (see ``exact_distribution``), one *other* cell holding the
  exact remaining mass, and *impossible* prefixes (a token outside the warped support after an enumerated prefix,
  i.e. probability exactly 0);
- ``tvd``: total-variation distance between the empirical and the exact distribution over those cells (a lower bound
  of the distance over all prefixes); ``tvd_noise``: what an exact sampler would show on average with as many
  samples (a normal approximation), for scale;
- ``chi2``/``df``/``p_value``: Pearson's chi-square goodness of fit after pooling every cell whose expected count is
  below 5 (impossible prefixes included) into one cell; the survival function is the regularised upper incomplete
  gamma function ``Q(df/2, x/2)`` (``torch.special.gammaincc``); when a single cell is left (one possible prefix),
  any impossible sample fails the test;
- verdict: a test passes when ``p_value >= alpha / m``, with ``m`` the number of tests of one engine (prompts times
  prefix lengths, Bonferroni). An engine passes when all its tests pass, so a correct engine is flagged with
  probability at most ``alpha`` (up to the chi-square approximation), whatever the dependence between its tests;
  with E correct engines the chance of any false alarm is at most ``E * alpha``.

Seeds: request ``s`` of a prompt uses seed ``base + s`` (``base``: the ``seed`` of the given ``SamplingParams``, or
0), and the requests of all prompts are interleaved, so every batch mixes prompt lengths.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..progress import Progress
from .inputs import Context, load_inputs

OTHER = "other"
IMPOSSIBLE = "impossible"


# --------------------------------------------------------------------------------------------------- the reference


def _warpers(temperature: float, top_k: int = 0, top_p: float = 1.0) -> list:
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if not temperature > 0:
        raise ValueError(f"the distributional reference needs temperature > 0, got {temperature}")
    out = [TemperatureLogitsWarper(float(temperature))]
    if top_k and top_k > 0:
        out.append(TopKLogitsWarper(int(top_k)))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(float(top_p)))
    return out


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token probabilities (float64, ``[B, V]``) from raw ``logits`` ``[B, V]`` after Hugging Face's
    temperature, top-k (0: off) and top-p (1.0: off) warpers, applied in that order."""
    scores = logits.double()
    ids = input_ids if input_ids is not None else torch.zeros((scores.shape[0], 1), dtype=torch.long)
    for w in _warpers(temperature, top_k, top_p):
        scores = w(ids, scores)
    return scores.softmax(-1)


@torch.no_grad()
def next_token_probs(model, prefixes: list[list[int]], temperature: float, top_k: int = 0, top_p: float = 1.0,
                     chunk: int = 64) -> torch.Tensor:
    """Warped next-token probabilities after each of ``prefixes`` (float64 on the CPU, ``[len(prefixes), V]``).

    Prefixes of equal length share one forward of up to ``chunk`` rows (no padding, no cache): row results do not
    depend on what else is in the forward beyond floating-point reduction order."""
    out: list[torch.Tensor | None] = [None] * len(prefixes)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prefixes):
        by_len.setdefault(len(p), []).append(i)
    dev = next(model.parameters()).device
    for rows in by_len.values():
        for s in range(0, len(rows), chunk):
            part = rows[s:s + chunk]
            ids = torch.tensor([prefixes[i] for i in part], dtype=torch.long, device=dev)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, -1]
            probs = warped_probs(logits.cpu(), temperature, top_k, top_p, ids.cpu())
            for j, i in enumerate(part):
                out[i] = probs[j]
    return torch.stack(out)


@dataclass
class Reference:
    """The exact distribution of the first ``n_tokens`` generated tokens (see ``exact_distribution``).

    ``cells[L-1]`` maps each enumerated L-token prefix to its exact probability; ``supports`` maps each expanded
    prefix (the empty prefix, then the enumerated prefixes up to length ``n_tokens - 1``) to a bool mask of the tokens
    with probability > 0 after it (None: every token)."""

    prompt: list[int]
    n_tokens: int
    cells: list[dict[tuple[int, ...], float]]
    supports: dict[tuple[int, ...], torch.Tensor | None] = field(repr=False)

    def other(self, length: int) -> float:
        """Exact mass of the ``length``-token prefixes that were not enumerated."""
        return max(0.0, 1.0 - math.fsum(self.cells[length - 1].values()))

    def classify(self, tokens, length: int):
        """The cell of a sampled sequence's ``length``-token prefix: the prefix itself, ``OTHER`` (not enumerated,
        probability > 0) or ``IMPOSSIBLE`` (probability 0 under the reference, or fewer than ``length`` tokens)."""
        tokens = tuple(int(t) for t in tokens[:length])
        if len(tokens) < length:
            return IMPOSSIBLE
        for j in range(length):
            parent = tokens[:j]
            if parent not in self.supports:
                return OTHER
            mask = self.supports[parent]
            t = tokens[j]
            if mask is not None and not (0 <= t < mask.numel() and bool(mask[t])):
                return IMPOSSIBLE
            if mask is None and t < 0:
                return IMPOSSIBLE
        return tokens if tokens in self.cells[length - 1] else OTHER


def exact_distribution(model, prompt: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0,
                       n_tokens: int = 2, coverage: float = 0.999, max_cells: int = 1024, min_mass: float = 0.0,
                       chunk: int = 64) -> Reference:
    """Exact distribution of the first ``n_tokens`` tokens that plain sampling from ``model`` generates after
    ``prompt``, with HF's warpers (temperature, then top-k, then top-p).

    Level by level: the first token's warped distribution comes from one forward of the prompt; for each enumerated
    prefix ``t1..tj`` one forward of ``prompt + t1..tj`` (batched ``chunk`` at a time, all of the same length) gives
    the next token's warped distribution, and a prefix's probability is the product of its tokens' probabilities.

    Enumeration is capped for large vocabularies: at each length only the most probable prefixes are kept, in
    descending order, until they cover ``coverage`` of the mass or number ``max_cells``; every other prefix of
    positive probability is pooled into one "other" cell whose exact mass is ``1 - sum(enumerated)``, and only
    enumerated prefixes of probability at least ``min_mass`` are extended to the next length (the audit passes
    ``1 / samples``: the extensions of a rarer prefix all expect fewer than one sample, so the chi-square test would
    pool them anyway). With a small vocabulary (or top-k / top-p) and ``coverage=1.0`` the whole support is
    enumerated. Cost: one forward row per extended prefix (plus the prompt's), ``chunk`` rows per forward, and
    memory for ``chunk`` distributions at a time; ``n_tokens`` of 1 or 2 is what this is meant for.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    if max_cells < 1:
        raise ValueError(f"max_cells must be >= 1, got {max_cells}")
    prompt = [int(t) for t in prompt]
    cells: list[dict[tuple[int, ...], float]] = []
    supports: dict[tuple[int, ...], torch.Tensor | None] = {}
    parents: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    for level in range(n_tokens):
        if not parents:  # nothing frequent enough to extend: every prefix of this length is "other"
            cells.append({})
            continue
        # per chunk of parents: record supports, keep the chunk's best candidates (memory: chunk x vocabulary)
        cand_val, cand_parent, cand_tok = [], [], []
        for start in range(0, len(parents), chunk):
            part = parents[start:start + chunk]
            probs = next_token_probs(model, [prompt + list(p) for p, _ in part], temperature, top_k, top_p, chunk)
            for (p, _), row in zip(part, probs):
                keep = row > 0
                supports[p] = None if bool(keep.all()) else keep.clone()
            joint = (torch.tensor([m for _, m in part], dtype=torch.float64)[:, None] * probs).flatten()
            top, idx = joint.topk(min(max_cells, int((joint > 0).sum())))
            v = probs.shape[1]
            cand_val.append(top)
            cand_parent.append(start + idx // v)
            cand_tok.append(idx % v)
        val, parent_i, tok = torch.cat(cand_val), torch.cat(cand_parent), torch.cat(cand_tok)
        top, order = val.topk(min(max_cells, val.numel()))  # descending
        before = top.cumsum(0) - top
        n_keep = max(1, int((before < coverage).sum()))
        level_cells = {}
        for val_i, o in zip(top[:n_keep].tolist(), order[:n_keep].tolist()):
            level_cells[parents[int(parent_i[o])][0] + (int(tok[o]),)] = val_i
        cells.append(level_cells)
        if level + 1 < n_tokens:
            parents = [(p, m) for p, m in level_cells.items() if m >= min_mass]
    return Reference(prompt, n_tokens, cells, supports)


# --------------------------------------------------------------------------------------------------- statistics


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution with ``df`` degrees of freedom: ``Q(df/2, x/2)``."""
    if df < 1:
        return 1.0 if x <= 0 else 0.0
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    a = torch.tensor(df / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(x / 2.0, dtype=torch.float64)))


def pool_cells(observed: list[float], expected: list[float], min_expected: float = 5.0
               ) -> tuple[list[float], list[float]]:
    """Pool every cell with expected count below ``min_expected`` into one cell; while that pool is still below
    ``min_expected``, the smallest remaining cell joins it. Returns the pooled (observed, expected)."""
    order = sorted(range(len(expected)), key=lambda i: expected[i])
    small = [i for i in order if expected[i] < min_expected]
    rest = [i for i in order if expected[i] >= min_expected]
    if not small:
        return [observed[i] for i in rest], [expected[i] for i in rest]
    po, pe = sum(observed[i] for i in small), sum(expected[i] for i in small)
    while pe < min_expected and rest:
        i = rest.pop(0)
        po, pe = po + observed[i], pe + expected[i]
    return [observed[i] for i in rest] + [po], [expected[i] for i in rest] + [pe]


def chi_square(observed: list[float], expected: list[float], min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of counts ``observed`` against expected counts ``expected`` (same total),
    cells below ``min_expected`` pooled (``pool_cells``). Returns (statistic, degrees of freedom, p-value).

    A pooled cell with expected count 0 and observed count > 0 (only possible when nothing else could be pooled with
    it) gives an infinite statistic; a single cell after pooling has df 0 and p-value 1."""
    o, e = pool_cells(observed, expected, min_expected)
    stat = 0.0
    for oi, ei in zip(o, e):
        if ei > 0:
            stat += (oi - ei) ** 2 / ei
        elif oi > 0:
            stat = math.inf
    df = len(o) - 1
    if df < 1:
        return (stat if math.isinf(stat) else 0.0), 0, (0.0 if math.isinf(stat) else 1.0)
    return stat, df, chi2_sf(stat, df)


def expected_noise_tvd(probs: list[float], n: int) -> float:
    """Mean total-variation distance of an exact sampler's empirical distribution from ``probs`` after ``n`` draws:
    ``0.5 * sum E|X_i/n - p_i|`` with the normal approximation (capped at ``2 p (1 - p)``, its value for rare cells)."""
    total = 0.0
    for p in probs:
        if 0 < p < 1:
            total += min(math.sqrt(2 * p * (1 - p) / (math.pi * n)), 2 * p * (1 - p))
    return 0.5 * total


@dataclass
class Comparison:
    tvd: float
    tvd_noise: float
    chi2: float
    df: int
    p_value: float
    cells: int  # cells before pooling (enumerated prefixes, "other" when it has mass, impossible ones seen)
    impossible: int  # samples whose prefix has probability 0 under the reference
    other_mass: float


def compare(ref: Reference, outputs: list[list[int]], length: int, min_expected: float = 5.0) -> Comparison:
    """Compare the ``length``-token prefixes of ``outputs`` with the reference."""
    n = len(outputs)
    counts: dict = {}
    for o in outputs:
        c = ref.classify(o, length)
        counts[c] = counts.get(c, 0) + 1
    cells = ref.cells[length - 1]
    other = ref.other(length)
    keys = list(cells)
    probs = [cells[k] for k in keys]
    if other > 1e-12 or counts.get(OTHER, 0):  # below that, rounding of a fully enumerated support
        keys.append(OTHER)
        probs.append(other)
    impossible = counts.get(IMPOSSIBLE, 0)
    obs = [counts.get(k, 0) for k in keys]
    if impossible:
        obs.append(impossible)
        probs.append(0.0)
    tvd = 0.5 * sum(abs(o / n - p) for o, p in zip(obs, probs)) if n else 0.0
    stat, df, pv = chi_square(obs, [p * n for p in probs], min_expected)
    if impossible and df == 0:
        pv = 0.0
    return Comparison(tvd, expected_noise_tvd(probs, n), stat, df, pv, len(obs), impossible, other)


# --------------------------------------------------------------------------------------------------- the audit


@dataclass
class DistributionRow:
    engine: str
    prompt: int  # index into the audited prompts
    n_tokens: int  # length of the tested prefix
    samples: int
    tvd: float
    tvd_noise: float
    chi2: float
    df: int
    p_value: float
    threshold: float  # the test passes when p_value >= threshold (alpha / tests per engine)
    impossible: int
    other_mass: float
    cells: int
    passed: bool

    def as_dict(self) -> dict:
        return dict(self.__dict__)


COLUMNS = ("engine", "prompt", "tokens", "samples", "TVD", "noise TVD", "chi2", "df", "p-value", "impossible",
           "verdict")


def _fmt_p(p: float) -> str:
    return f"{p:.3g}" if p >= 1e-3 else f"{p:.1e}"


@dataclass
class DistributionReport:
    rows: list[DistributionRow]
    meta: dict

    def engines(self) -> dict[str, bool]:
        """Engine name -> passed (every one of its tests passed)."""
        out: dict[str, bool] = {}
        for r in self.rows:
            out[r.engine] = out.get(r.engine, True) and r.passed
        return out

    def passed(self, engine: str | None = None) -> bool:
        """Whether ``engine`` passed; with no engine, whether every engine other than an injected fault passed."""
        verdicts = self.engines()
        if engine is not None:
            return verdicts[engine]
        return all(v for e, v in verdicts.items() if not e.startswith("fault:"))

    def row(self, engine: str, prompt: int, n_tokens: int) -> DistributionRow:
        for r in self.rows:
            if (r.engine, r.prompt, r.n_tokens) == (engine, prompt, n_tokens):
                return r
        raise KeyError((engine, prompt, n_tokens))

    def min_p_value(self, engine: str) -> float:
        return min(r.p_value for r in self.rows if r.engine == engine)

    def as_dict(self) -> dict:
        return {"meta": self.meta, "engines": self.engines(), "rows": [r.as_dict() for r in self.rows]}

    def to_json(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.as_dict(), indent=1))
        return path

    def _cells(self, r: DistributionRow) -> list[str]:
        return [r.engine, str(r.prompt), str(r.n_tokens), str(r.samples), f"{r.tvd:.4f}", f"{r.tvd_noise:.4f}",
                f"{r.chi2:.1f}", str(r.df), _fmt_p(r.p_value), str(r.impossible), "pass" if r.passed else "FAIL"]

    def to_markdown(self) -> str:
        m = self.meta
        head = (f"Distributional audit: temperature {m['temperature']}, top-k {m['top_k']}, top-p {m['top_p']}, "
                f"{m['samples']} samples per prompt, first {m['n_tokens']} tokens, alpha {m['alpha']} per engine "
                f"(per-test threshold {m['threshold']:.2g}).\n\n")
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(self._cells(r)) + " |" for r in self.rows]
        verdicts = "\n".join(f"- {e}: {'pass' if ok else 'FAIL'}" for e, ok in self.engines().items())
        return head + "\n".join(lines) + "\n\n" + verdicts + "\n"

    def rich_table(self):
        from rich.table import Table

        t = Table(title=f"distributional audit (T={self.meta['temperature']}, top-k {self.meta['top_k']}, "
                        f"top-p {self.meta['top_p']}, {self.meta['samples']} samples)")
        for c in COLUMNS:
            t.add_column(c, justify="left" if c in ("engine", "verdict") else "right")
        for r in self.rows:
            cells = self._cells(r)
            cells[-1] = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
            t.add_row(*cells)
        return t


def _engine_specs(engines) -> list:
    from .engines import BatchspecEngine, resolve

    specs = resolve(engines, sampling=True)  # "faults": every injected fault changes what is sampled
    for s in specs:
        if not isinstance(s, BatchspecEngine):
            raise ValueError(f"the distributional audit runs batchspec engines only, not {s.name!r}")
    return specs


def distribution_audit(
    target,
    draft=None,
    prompts=(),
    sampling=None,
    engines=("slotmask", "eqspec"),
    num_draft_tokens: int = 5,
    samples: int = 2000,
    n_tokens: int = 2,
    batch_size: int = 64,
    alpha: float = 1e-3,
    tokenizer=None,
    progress: bool = False,
    *,
    dtype=None,
    device=None,
    coverage: float = 0.999,
    max_cells: int = 1024,
) -> DistributionReport:
    """Check that each engine samples the first ``n_tokens`` tokens from the exact distribution of plain sampling
    from ``target`` with ``sampling``'s temperature, top-k and top-p.

    ``target``/``draft``/``tokenizer``/``prompts`` are given as to ``batchspec.audit``. ``engines``: ``"slotmask"``,
    ``"eqspec"`` (with ``draft``: a model or ``"prompt-lookup"``), ``"plain"``, ``"fault:<name>"`` or ``"faults"``
    (every injected fault). ``sampling``: a ``SamplingParams`` with temperature > 0; its ``max_tokens``, stop ids and
    ``ignore_eos`` are replaced (every request generates exactly ``n_tokens`` tokens, EOS ignored) and its ``seed``
    (None: 0) is the first of the ``samples`` consecutive request seeds. ``coverage``/``max_cells``: the
    enumeration cap of the reference (``exact_distribution``; prefixes rarer than ``1 / samples`` are not extended). ``alpha``: the false-alarm rate per engine (see the
    module docstring). Returns a ``DistributionReport``.
    """
    from ..params import SamplingParams


    if sampling is None or not sampling.temperature > 0:
        raise ValueError("the distributional audit needs SamplingParams with temperature > 0")
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an integer >= 1, got {samples!r}")
    if not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an integer >= 1, got {n_tokens!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    specs = _engine_specs(engines)
    if not specs:
        raise ValueError("no engines to audit")
    model, draft, tok, ids, _ = load_inputs(target, draft, tokenizer, prompts, dtype, device)
    temperature, top_k, top_p = float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)
    base = int(sampling.seed or 0)
    # request r = s * len(ids) + i: sample s of prompt i (prompts interleaved, so every batch mixes lengths)
    requests = [(i, s) for s in range(samples) for i in range(len(ids))]
    params = [SamplingParams(max_tokens=n_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=base + s, ignore_eos=True) for _, s in requests]
    tests = len(ids) * n_tokens
    threshold = alpha / tests
    chunk = batch_size * max(1, 1024 // batch_size)

    ctx = Context(model, draft, tok, num_draft_tokens, n_tokens, [])
    rows: list[DistributionRow] = []
    engine_meta = {}
    with Progress(progress, len(ids) + len(specs) * len(requests), "audit") as bar:
        bar.describe("exact reference (HF warpers, batch size 1)")
        refs = []
        for p in ids:
            refs.append(exact_distribution(model, p, temperature, top_k, top_p, n_tokens, coverage, max_cells,
                                           min_mass=1.0 / samples))
            bar.advance()
        for spec in specs:
            bar.describe(f"{spec.name}: sampling")
            llm = spec.llm(ctx, batch_size)
            outs: list[list[int]] = []
            t0 = time.perf_counter()
            for c in range(0, len(requests), chunk):
                part = range(c, min(c + chunk, len(requests)))
                res = llm.generate([ids[requests[r][0]] for r in part], [params[r] for r in part])
                outs += [o.token_ids for o in res]
                for _ in part:
                    bar.advance()
            seconds = time.perf_counter() - t0
            engine_meta[spec.name] = {"layout": spec.spec.layout, "fault": spec.spec.fault, "draft": spec.spec.drafter,
                                      "seconds": seconds, "mean_accepted_length": llm.stats.mean_accepted_length}
            for i, ref in enumerate(refs):
                mine = outs[i::len(ids)]
                for length in range(1, n_tokens + 1):
                    c = compare(ref, mine, length)
                    rows.append(DistributionRow(
                        engine=spec.name, prompt=i, n_tokens=length, samples=len(mine), tvd=c.tvd,
                        tvd_noise=c.tvd_noise, chi2=c.chi2, df=c.df, p_value=c.p_value, threshold=threshold,
                        impossible=c.impossible, other_mass=c.other_mass, cells=c.cells,
                        passed=c.p_value >= threshold,
                    ))

    meta = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "samples": samples, "n_tokens": n_tokens,
        "seeds": [base, base + samples - 1], "alpha": alpha, "tests_per_engine": tests, "threshold": threshold,
        "batch_size": batch_size, "num_draft_tokens": num_draft_tokens, "n_prompts": len(ids),
        "prompt_lengths": [len(p) for p in ids], "target_dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device), "coverage": coverage, "max_cells": max_cells,
        "reference_cells": [[len(c) for c in r.cells] for r in refs],
        "reference_other_mass": [[r.other(L) for L in range(1, n_tokens + 1)] for r in refs],
        "engines": engine_meta,
    }
    return DistributionReport(rows, meta)
