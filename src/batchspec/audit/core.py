"""``audit``: run engines at several batch sizes, compare every output with the batch-size-1 oracle, attribute each
divergence (numerical, synchronization or a wrong reference) and name the failure signature of each engine and batch
size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..progress import Progress
from . import attribution as attr
from . import metrics
from .engines import resolve
from .inputs import Context, load_inputs
from .oracle import Oracle
from .report import AuditReport, AuditRow

if TYPE_CHECKING:
    from .distribution import DistributionReport


def audit(
    target,
    draft=None,
    prompts=(),
    engines=("slotmask", "eqspec"),
    batch_sizes=(1, 4, 8),
    max_tokens: int = 64,
    num_draft_tokens: int = 5,
    tokenizer=None,
    *,
    stop_token_ids=(),
    tolerance=None,
    dtype=None,
    device=None,
    cache_dir=None,
    progress: bool = False,
    sampling=None,
    samples: int = 2000,
    n_tokens: int = 2,
    alpha: float = 1e-3,
    weights: str = "auto",
) -> AuditReport | DistributionReport:
    """Audit ``engines`` against HF greedy decoding of ``target`` at batch size 1.

    ``target``/``draft``/``tokenizer`` are given as to ``batchspec.LLM``; ``prompts`` are strings (encoded with the
    tokenizer, no chat template) or token-id lists. ``engines``: names or callables (see ``batchspec.audit.engines``).
    Outputs end at the first stop token (the target's EOS ids plus ``stop_token_ids``) or at ``max_tokens``.
    ``tolerance``: the relative margin tolerance, as a number or a dict of dtype -> number (see
    ``batchspec.audit.attribution``). ``cache_dir``: where oracle outputs are cached (None: ``$BATCHSPEC_CACHE/oracle``
    or ``~/.cache/batchspec/oracle``; False: no cache). ``weights``: what batchspec's engines run on, as in ``LLM``
    (the oracle is always HF on the weights as loaded).

    Returns an ``AuditReport`` whose ``rows`` hold, per engine and batch size: ``exact_match`` (fraction),
    ``partial_match`` and ``rouge_l`` (means), ``repetition_rate``, ``n``, ``divergences`` (prompt, first divergent
    index, margin, class: numerical, synchronization or reference), ``signature``, ``first_violated_invariant``
    (batchspec engines) and ``tokens_per_second``.

    ``sampling``: a ``SamplingParams`` with temperature > 0 switches to the distributional audit
    (``batchspec.audit.distribution.distribution_audit``): ``samples`` seeded requests per prompt, the first
    ``n_tokens`` tokens compared with their exact distribution at batch size ``max(batch_sizes)``, false-alarm rate
    ``alpha`` per engine; it returns a ``DistributionReport``. ``max_tokens``, ``stop_token_ids``, ``tolerance`` and
    ``cache_dir`` do not apply there.
    """
    if sampling is not None and sampling.temperature > 0:
        from .distribution import distribution_audit

        return distribution_audit(
            target, draft, prompts, sampling, engines=engines, num_draft_tokens=num_draft_tokens, samples=samples,
            n_tokens=n_tokens, batch_size=max([int(b) for b in batch_sizes] or [1]), alpha=alpha, tokenizer=tokenizer,
            progress=progress, dtype=dtype, device=device,
        )
    from batchspec.model.loading import eos_ids

    batch_sizes = [int(b) for b in batch_sizes]
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"batch sizes must be integers >= 1, got {batch_sizes}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    specs = resolve(engines)
    if not specs:
        raise ValueError("no engines to audit")
    model, draft, tok, ids, engine_model = load_inputs(target, draft, tokenizer, prompts, dtype, device, weights)
    stops = sorted(eos_ids(model) | {int(s) for s in stop_token_ids})
    ctx = Context(model, draft, tok, num_draft_tokens, max_tokens, [int(s) for s in stop_token_ids], engine_model)

    with Progress(progress, len(ids) + len(specs) * len(batch_sizes), "audit") as bar:
        bar.describe("oracle (HF greedy, batch size 1)")
        oracle = Oracle(model, max_tokens, stops, cache_dir)
        ref = oracle(ids, bar.advance)
        probe = attr.MarginProbe(model)
        rows = []
        for engine in specs:
            for bs in batch_sizes:
                bar.describe(f"{engine.name} B={bs}")
                rows.append(_audit_one(engine, bs, ctx, ids, ref, stops, probe, tolerance))
                bar.advance()

    meta = {
        "target_fingerprint": oracle.fingerprint, "target_dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device), "n_prompts": len(ids), "max_tokens": max_tokens,
        "num_draft_tokens": num_draft_tokens, "stop_ids": stops, "batch_sizes": batch_sizes,
        "engines": [e.name for e in specs], "tolerance": _tolerance_table(tolerance),
        "engine_weights": _weights_line(engine_model),
        "oracle_repetition_rate": metrics.repetition_rate(ref, stops),
        "oracle_cache": {"dir": str(oracle.dir) if oracle.dir else None, "hits": oracle.hits, "misses": oracle.misses},
    }
    return AuditReport(rows, meta, ref)


def _weights_line(model) -> str:
    from batchspec.model.weights import report

    return report(model).line()


def _audit_one(engine, bs, ctx, ids, ref, stops, probe, tolerance) -> AuditRow:
    raw, seconds = engine.run(ctx, ids, bs)
    outs = [metrics.truncate(o, stops, ctx.max_tokens) for o in raw]
    n = len(ids)
    rel_tol = attr.relative_tolerance(attr.coarser(ctx.target.dtype, engine.dtype(ctx)), tolerance)
    divs = []
    for i, (o, r) in enumerate(zip(outs, ref)):
        j = metrics.first_divergence(o, r)
        if j is not None:
            divs.append(probe.divergence(i, ids[i], o, r, j, rel_tol))
    sync = [d for d in divs if d.cls == "synchronization"]
    n_ref = sum(d.cls == "reference" for d in divs)
    violation = None
    batches = engine.batches(n, bs)
    if engine.white_box:
        if sync:
            bad = {d.prompt for d in sync}
            for batch in batches:
                if bad & set(batch):
                    err = engine.first_violation(ctx, ids, batch)
                    if err is not None:
                        violation = attr.invariant_record(err, batch)
                        break
        signature = attr.white_box_signature(len(sync), violation, n_reference=n_ref)
    else:
        records = _black_box_records(engine, ctx, ids, outs, ref, sync, batches, stops, probe, rel_tol)
        signature = attr.black_box_signature(bs, records, n_reference=n_ref)
    return AuditRow(
        engine=engine.name, batch_size=bs, n=n,
        exact_match=sum(metrics.exact_match(o, r) for o, r in zip(outs, ref)) / n if n else 1.0,
        partial_match=sum(metrics.partial_match(o, r) for o, r in zip(outs, ref)) / n if n else 1.0,
        rouge_l=sum(metrics.rouge_l(o, r) for o, r in zip(outs, ref)) / n if n else 1.0,
        repetition_rate=metrics.repetition_rate(outs, stops),
        divergences=divs, signature=signature, first_violated_invariant=violation,
        tokens_per_second=sum(len(o) for o in outs) / seconds if seconds > 0 else 0.0,
        outputs=outs,
    )


def _black_box_records(engine, ctx, ids, outs, ref, sync, batches, stops, probe, rel_tol) -> list[dict]:
    longest = {}
    for batch in batches:
        m = max(len(ids[i]) for i in batch)
        longest.update({i: m for i in batch})
    recs = []
    for d in sync:
        i = d.prompt
        recs.append({
            "prompt": i, "partial_match": metrics.partial_match(outs[i], ref[i]), "padded": len(ids[i]) < longest[i],
            "loops": metrics.ends_in_loop(outs[i], stops), "oracle_loops": metrics.ends_in_loop(ref[i], stops),
            "solo_clean": None,
        })
    # the padding rule needs to know whether the padded rows decode cleanly alone: only asked when it could apply
    if max(len(b) for b in batches) > 1 and recs and all(r["padded"] for r in recs):
        for r in recs:
            i = r["prompt"]
            solo = metrics.truncate(engine.call([ids[i]])[0], stops, ctx.max_tokens)
            j = metrics.first_divergence(solo, ref[i])
            r["solo_clean"] = j is None or probe.divergence(i, ids[i], solo, ref[i], j, rel_tol).cls == "numerical"
    return recs


def _tolerance_table(tolerance) -> dict:
    if isinstance(tolerance, (int, float)):
        return {"all": float(tolerance)}
    table = {str(k).removeprefix("torch."): v for k, v in attr.DEFAULT_TOLERANCE.items()}
    if tolerance:
        table.update({str(k).removeprefix("torch."): float(v) for k, v in tolerance.items()})
    return table
