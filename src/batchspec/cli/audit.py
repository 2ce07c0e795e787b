"""``batchspec audit``: run engines against the batch-size-1 oracle and write audit.json, audit.md, audit.png and
audit.html; with ``--temperature`` > 0, the distributional audit (distribution.json, distribution.md); with
``--endpoint``, the audit of a running server (against the local oracle, a reference server or itself at concurrency
1), or with ``--repeat`` its determinism run (determinism.json, .md, .png, .html)."""

from __future__ import annotations

import os

from .common import (DEFAULT_TARGET, TARGET_HELP, encode_prompts, int_list, model_args, non_negative_int,
                     positive_float, positive_int, prepare_out, read_prompt_set, resolve_draft, rich_console,
                     sampling_flags, show_table, write_atomic)

HELP = "audit engines (or a running server) against the batch-size-1 oracle"


def add_arguments(parser) -> None:
    model_args(parser, None, (  # the default depends on --endpoint: run() fills it in
        f"{TARGET_HELP}; with --endpoint it is the local "
        "oracle's model, or with --reference (or --repeat) only where the tokenizer comes from; --endpoint without "
        "--target audits against --reference self"))
    parser.description = (
        "Compare engines with HF greedy decoding at batch size 1 (exact match, partial match, ROUGE-L, repetition), "
        "attribute each divergence to numerical noise or a synchronization error, and name each failure signature. "
        "Exits with status 1 when an engine other than an injected fault is not clean. With --temperature > 0: "
        "the distributional audit instead (the first --n-tokens sampled tokens of --samples seeded requests per "
        "prompt against their exact distribution; exits with status 1 when an engine other than an injected fault "
        "fails)."
    )
    parser.add_argument(
        "--engines", default="slotmask,eqspec",
        help="comma list of engine names: plain, slotmask, eqspec, slotmask-lookup, fault:<name>, or 'faults' for "
             "every injected fault, each with an optional :fixed / :adaptive and @static / @continuous / @exspec "
             "(default slotmask,eqspec)",
    )
    parser.add_argument(
        "--batch-sizes", default=None,
        help="comma list of batch sizes (default 1,4,8; with --temperature > 0 the largest is used, default 64)",
    )
    parser.add_argument(
        "--out", default="out/audit",
        help="folder for audit.json, audit.md, audit.png, audit.html; with --temperature > 0, distribution.json "
             "and distribution.md; with --repeat, determinism.json, .md, .png and .html (default out/audit)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help="relative logit-margin tolerance for calling a divergence numerical (default per dtype: float64 1e-6, "
             "float32 1e-5, float16 2e-2, bfloat16 5e-2; times max(1, max |logit|))",
    )
    parser.add_argument("--limit", type=positive_int, default=None, help="audit only the first N prompts")
    endpoint = parser.add_argument_group(
        "endpoint audit", "audit a running OpenAI-compatible server (any engine) at several concurrency levels instead "
        "of local engines (--engines and --batch-sizes do not apply), against the local oracle of --target when "
        "--target is given without --reference, else against --reference (default: self, the server at concurrency "
        "1), with no model loaded. The whole "
        "output is compared: tokens past the first stop token or --max-tokens are an overrun; token ids that are not "
        "integers of the vocabulary, a finish_reason that disagrees with the tokens and prompt ids other than those "
        "sent are reported; requests that fail are not compared. Exit status: 1 when a level is not clean (a "
        "synchronization divergence, an overrun, a protocol error, a prompt mismatch, or some requests failed: "
        "incomplete), else 2 when a level could not be audited (every request failed) or the outputs are too short "
        "to prove anything (proved little), else 0 (every level clean); 2 also when the server cannot be reached "
        "and for usage errors")
    endpoint.add_argument("--endpoint", default=None, metavar="URL",
                          help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    endpoint.add_argument("--model", default=None, help="the server's model id (default: the first of /v1/models)")
    endpoint.add_argument("--concurrency", default="1,8,32",
                          help="comma list of how many requests are under way at once (default 1,8,32)")
    endpoint.add_argument("--api", default=None, choices=["completions", "chat"],
                          help="completions: prompts go as token ids (exact); chat: as user messages, templated by "
                               "the server (default: completions with --target, whose tokenizer applies the template, "
                               "or with --repeat or --no-chat-template; else chat, so that the prompts are templated)")
    endpoint.add_argument("--stream", action="store_true", help="read the answers as Server-Sent Events")
    endpoint.add_argument("--api-key", default=os.environ.get("BATCHSPEC_API_KEY"),
                          help="sent as 'Authorization: Bearer KEY' (default: $BATCHSPEC_API_KEY)")
    endpoint.add_argument("--timeout", type=positive_float, default=600.0,
                          help="seconds to wait for the server at most: for /v1/models and for each answer (a stream: "
                               "all of it); > 0 (default 600)")
    endpoint.add_argument("--reference", default=None, metavar="URL|self",
                          help="compare with another server's answers (e.g. the same model with speculation off) or "
                               "with the server's own at concurrency 1 (self); no model is loaded: --target, if "
                               "given, only provides the tokenizer to send text prompts as token ids (without it they "
                               "go as text); divergences are attributed from the reference's logprobs, else "
                               "unattributed (default: self when --target is not given)")
    endpoint.add_argument("--reference-model", default=None,
                          help="the reference server's model id (default: the first of its /v1/models)")
    endpoint.add_argument("--top-logprobs", type=int, default=5,
                          help="log-probabilities asked of the reference server per position, as token ids, to "
                               "attribute divergences (0: none; default 5); --dtype names the servers' dtype for the "
                               "tolerance (default float32; give bfloat16 or float16 for servers that compute in them)")
    endpoint.add_argument("--repeat", type=positive_int, default=None, metavar="N",
                          help="the determinism run instead: send each prompt N >= 2 times, greedy, at the "
                               "--concurrency levels in turn, and count each prompt's unique outputs (no reference, "
                               "no model); exit status 1 when a prompt has more than one")
    endpoint.add_argument("--save", default=None, metavar="FILE",
                          help="record a baseline instead: each prompt's tokens, finish_reason and top logprobs at "
                               "every level, with the server's fingerprint; the logprobs are checked")
    endpoint.add_argument("--against", default=None, metavar="FILE",
                          help="send a baseline's requests again (its prompts, levels and settings) and report each "
                               "drift, with a reproducer in --out/repro")
    endpoint.add_argument("--features", default=None, metavar="LIST",
                          help="also audit request features: a comma list of json, tools, penalties, logit_bias, "
                               "stop, logprobs, n, seed, or all; each is sent as chat requests at concurrency 1 and "
                               "at the highest level, compared with --reference (default: the server itself at "
                               "concurrency 1) and checked by a rule of its own; a feature refused with HTTP 400 is "
                               "unsupported, not a failure, and seed (sampled twice with a fixed seed) is reported, "
                               "never failed")
    endpoint.add_argument("--junit", default=None, metavar="FILE",
                          help="also write a JUnit XML report for CI: one test case per prompt and level, failing "
                               "with its first divergence or problem")
    sampling = parser.add_argument_group("distributional audit (temperature > 0)")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="sampling temperature; > 0 runs the distributional audit (default 0: greedy audit)")
    sampling.add_argument("--top-k", type=non_negative_int, default=0, help="top-k warping (default 0: off)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="top-p warping (default 1.0: off)")
    sampling.add_argument("--samples", type=positive_int, default=2000,
                          help="seeded requests per prompt and engine (default 2000)")
    sampling.add_argument("--n-tokens", type=positive_int, default=2,
                          help="length of the generated prefix whose distribution is tested (default 2)")
    sampling.add_argument("--alpha", type=float, default=1e-3,
                          help="false-alarm rate per engine, Bonferroni-split over prompts and prefix lengths "
                               "(default 0.001)")


def run(args) -> int:
    import torch

    from ..audit.core import audit
    from ..audit.engines import resolve
    from ..engine.names import with_speculation
    from ..model.loading import load_model, load_tokenizer

    if args.endpoint is not None:
        return _run_endpoint(args)
    for flag, value in (("--reference", args.reference), ("--reference-model", args.reference_model),
                        ("--repeat", args.repeat), ("--features", args.features)):
        if value is not None:
            raise ValueError(f"{flag} applies to the endpoint audit: give --endpoint URL as well")
    args.target = args.target or DEFAULT_TARGET
    resolve_draft(args.target, args.draft)  # a misspelt model name fails here, before any model loads
    sampled = args.temperature > 0
    sampling = sampling_flags(args, max_tokens=args.n_tokens if sampled else args.max_tokens)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.speculation == "fixed":  # names without their own suffix take --speculation
        engines = [with_speculation(e, "fixed") for e in engines]
    resolve(engines, sampling=sampled)  # unknown engine names fail here, before any model loads
    batch_sizes = int_list(args.batch_sizes or ("64" if sampled else "1,4,8"), "--batch-sizes")
    pairs = read_prompt_set(args.prompts)[: args.limit]
    out = prepare_out(args.out, folder=True)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    tokenizer = load_tokenizer(args.target)
    _, _, prompts = encode_prompts(pairs, tokenizer, args.chat_template)
    if sampled:
        model = load_model(args.target, dtype, args.device, "target")
        return _run_sampled(args, model, tokenizer, prompts, engines, batch_sizes, sampling, out)
    report = audit(
        args.target, resolve_draft(args.target, args.draft), prompts, engines=engines, batch_sizes=batch_sizes,
        max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, tokenizer=tokenizer,
        tolerance=args.tolerance, progress=True, dtype=dtype, device=args.device, weights=args.weights,
    )
    _write_reports(out, "audit", report.as_dict(), report.to_markdown())
    report.plot(out / "audit.png")
    _write_html(out / "audit.html", report)
    console = rich_console()
    show_table(console, report.rich_table())
    console.print(f"wrote {out / 'audit.json'}, {out / 'audit.md'}, {out / 'audit.png'}, {out / 'audit.html'}")
    status, verdict = report.verdict()
    if status:
        console.print(f"[red]{verdict}[/red]")
    return status


def _run_endpoint(args) -> int:
    """``--endpoint``: the endpoint audit (``batchspec.audit.endpoint``), with ``--features`` its feature matrix;
    exit status 0 clean, 1 a level or a feature not clean, 2 one that could not be audited or outputs that proved
    little. With ``--repeat``: the determinism run; with ``--save`` or ``--against``: the baseline."""
    from rich.markup import escape

    from ..audit.endpoint import endpoint_markdown, endpoint_verdict, repro

    if args.temperature > 0:
        raise ValueError("--endpoint audits greedy decoding: leave --temperature at 0")
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ValueError("--endpoint needs httpx: install the serve extra, pip install 'batchspec[serve]'") from None
    if args.top_logprobs < 0:
        raise ValueError(f"--top-logprobs must be an integer >= 0, got {args.top_logprobs}")
    levels = int_list(args.concurrency, "--concurrency")
    features = _features(args)
    if args.save is not None or args.against is not None:
        args.api = args.api or "completions"
        return _run_baseline(args, levels)
    if args.repeat is not None:
        args.api = args.api or "completions"
        return _run_determinism(args, levels)
    if args.api is None:  # without a tokenizer here, the server's chat template is the only one the prompts can get
        args.api = "chat" if args.target is None and args.chat_template else "completions"
    reference = _endpoint_reference(args)
    pairs = read_prompt_set(args.prompts)[: args.limit]
    out = prepare_out(args.out, folder=True)
    try:
        report = _endpoint_audit(args, [t for _, t in pairs], levels, reference).run()
        if features:
            report.meta["features"] = _feature_matrix(args, [t for _, t in pairs], report, features)
    except ConnectionError as e:  # connection refused, unknown host, no answer from /v1/models
        raise ValueError(str(e)) from None
    made = repro.write_audit_repros(out, report.meta["endpoint"]["levels"], [i for i, _ in pairs])
    _write_reports(out, "audit", report.as_dict(), endpoint_markdown(report, made))
    if args.junit is not None:
        from ..audit.endpoint.junit import feature_cases, junit_xml, report_cases

        cases = report_cases(report, [i for i, _ in pairs])
        cases += feature_cases(report.meta["features"]) if features else []
        write_atomic(args.junit, lambda f: f.write(junit_xml(cases)))
    report.plot(out / "audit.png")
    _write_html(out / "audit.html", report)
    console = rich_console()
    _print_endpoint(console, report, pairs)
    console.print(f"wrote {out / 'audit.json'}, {out / 'audit.md'}, {out / 'audit.png'}, {out / 'audit.html'}"
                  + (f" and {len(made)} reproducers in {out / 'repro'}" if made else ""))
    status, verdict = endpoint_verdict(report)
    if status:
        console.print(f"[red]{escape(verdict)}[/red]")
    return status


def _run_baseline(args, levels) -> int:
    """``--save`` / ``--against``: record a baseline, or send a baseline's requests again and compare
    (``batchspec.audit.endpoint.baseline``); audit.json, audit.md, audit.html and the reproducers; exit status 0
    clean, 1 a case not clean, 2 none could be audited or the outputs proved little (``baseline.status``)."""

    import torch
    from rich.markup import escape

    from ..audit import attribution as attr
    from ..audit.endpoint import baseline, junit, repro
    from ..audit.html import baseline_html

    if args.repeat is not None or args.reference is not None:
        raise ValueError("--save and --against record and compare the server alone: leave out --repeat and "
                         "--reference")
    saved = baseline.load(args.against) if args.against is not None else None
    if saved is None:
        pairs = read_prompt_set(args.prompts)[: args.limit]
        names, prompts = [i for i, _ in pairs], [t for _, t in pairs]
        audit = _endpoint_audit(args, prompts, levels, None)
    else:
        s = saved["fingerprint"]["settings"]
        names, prompts = saved["names"], saved["prompts"]
        audit = _endpoint_audit(args, prompts, s["concurrency"], None)
        audit.model, audit.api, audit.stream, audit.max_tokens = s["model"], s["api"], s["stream"], s["max_tokens"]
        audit.top_logprobs, audit.stop_token_ids = s["top_logprobs"], s["stop_token_ids"]
    out = prepare_out(args.out, folder=True)
    try:
        new = baseline.record(audit, names, saved)
    except ConnectionError as e:
        raise ValueError(str(e)) from None
    if args.save is not None:
        baseline.save(args.save, new)
    rel_tol = attr.relative_tolerance(getattr(torch, args.dtype) if args.dtype else torch.float32, args.tolerance)
    cases = baseline.cases(new, saved, rel_tol)
    made = repro.write_repros(out, cases, new, saved) if saved is not None else {}
    md = baseline.baseline_markdown(cases, new, saved, made)
    _write_reports(out, "audit", {"cases": cases, "fingerprint": new["fingerprint"]}, md)
    page = baseline_html(cases, new, saved, made)
    write_atomic(out / "audit.html", lambda f: f.write(page))
    if args.junit is not None:
        write_atomic(args.junit, lambda f: f.write(junit.junit_xml(cases)))
    console = rich_console()
    for c in [c for c in cases if c["status"] != baseline.CLEAN][:10]:
        console.print(escape(f"prompt {c['name']} at concurrency {c['concurrency']}: {c['status']}: {c['summary']}"))
    status, verdict = baseline.status(cases)
    console.print(escape(f"{verdict}; wrote {out / 'audit.md'}, {out / 'audit.html'}"
                         + (f", {args.save}" if args.save else "")))
    return status


def _features(args) -> list[str]:
    """``--features`` checked: the feature names (none without the flag); refused with --repeat, --save, --against."""
    from ..audit.endpoint.features import parse_features

    if args.features is None:
        return []
    for flag, value in (("--repeat", args.repeat), ("--save", args.save), ("--against", args.against)):
        if value is not None:
            raise ValueError(f"--features adds to the endpoint audit: leave out {flag}")
    return parse_features(args.features)


def _feature_matrix(args, prompts: list, report, features: list[str]) -> dict:
    """The feature matrix (``batchspec.audit.endpoint.features``) at concurrency 1 and the audit's highest level,
    against --reference URL or else the server itself."""
    import torch

    from ..audit import attribution as attr
    from ..audit.endpoint import SELF, model_name
    from ..audit.endpoint.features import FeatureMatrix

    model = model_name(args.endpoint, args.model, args.api_key, args.timeout)
    other = args.reference if args.reference not in (None, SELF) else None
    ref_model = model_name(other, args.reference_model, args.api_key, args.timeout, "--reference-model") if other \
        else args.reference_model or model
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32
    levels = sorted({1, max(report.meta["batch_sizes"])})
    return FeatureMatrix(args.endpoint, model, prompts, features, levels, other, ref_model, args.max_tokens,
                         args.api_key, args.timeout, attr.relative_tolerance(dtype, args.tolerance)).run()


def _endpoint_reference(args) -> str | None:
    """``--reference`` checked: None (the local oracle of --target), "self" (the default without --target) or a URL."""
    from ..audit.endpoint import SELF

    reference = args.reference
    if reference is None and args.reference_model is not None:
        raise ValueError("--reference-model names the model of --reference URL: give --reference as well")
    if reference is None and args.target is None:
        reference = SELF
    if reference is not None and reference != SELF and "://" not in reference:
        raise ValueError(f"--reference must be 'self' or a server's URL (http://host:port), got {reference!r}")
    return reference


def _endpoint_audit(args, prompts: list, levels: list[int], reference: str | None):
    """The ``EndpointAudit`` that the flags ask for."""
    import torch

    from ..audit.endpoint import EndpointAudit

    return EndpointAudit(
        args.endpoint, args.target, prompts, levels, args.model, reference=reference,
        reference_model=args.reference_model, max_tokens=args.max_tokens, api=args.api, stream=args.stream,
        chat_template=args.chat_template, api_key=args.api_key, tolerance=args.tolerance,
        dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device, timeout=args.timeout,
        top_logprobs=args.top_logprobs, progress=True,
    )


def _print_endpoint(console, report, pairs) -> None:
    """The endpoint audit on the console: its table, the reference's answers, a line per level with its first
    problems and divergences, a warning when the text was re-tokenized."""
    from rich.markup import escape

    from ..audit.endpoint import COULD_NOT_AUDIT

    show_table(console, report.rich_table())
    ref = report.meta.get("reference")
    if ref is not None:
        console.print(escape(f"reference: {report.meta['oracle']}; {ref['answers']} of {ref['requests']} answers "
                             f"usable ({ref['seconds']:.1f} s)"))
        for p in ref["problems"][:3]:
            console.print(escape(f"  prompt {p['prompt']} ({pairs[p['prompt']][0]}): reference {p['kind']}: "
                                 f"{p['detail']}"))
    ep = report.meta["endpoint"]
    if ep.get("capped"):
        console.print(escape(ep["capped"]))
    for row, lv in zip(report.rows, ep["levels"]):
        console.print(escape(_level_line(row, lv)))
        shown = [] if row.signature == COULD_NOT_AUDIT else lv["problems"][:3]  # the level's line has the first error
        for p in shown:
            console.print(escape(f"  prompt {p['prompt']} ({pairs[p['prompt']][0]}): {p['kind']}: {p['detail']}"))
        if shown and len(lv["problems"]) > len(shown):
            console.print(f"  ... {len(lv['problems']) - len(shown)} more in audit.json")
        for d in [d for d in row.divergences if d.cls not in ("numerical", "overrun")][:3]:
            console.print(escape(f"  prompt {d.prompt} ({pairs[d.prompt][0]}): first divergence at token {d.index}: "
                                 f"{d.engine_token} where the reference has {d.oracle_token} ({d.cls})"))
    for c in (report.meta.get("features") or {}).get("cells", []):
        if c["status"] not in ("clean", "deterministic"):
            first = f": {c['problems'][0]['detail']}" if c["problems"] else ""
            console.print(escape(f"feature {c['feature']} at concurrency {c['concurrency']}: {c['status']}{first}"))
    if ep["retokenized"]:
        console.print("[yellow]the server returned no token ids: its text was re-tokenized locally (last resort)"
                      "[/yellow]")


def _run_determinism(args, levels) -> int:
    """``--endpoint URL --repeat N``: the determinism run (``batchspec.audit.determinism``); exit status 0 when every
    prompt gave one output, 1 when one gave more (or requests failed), 2 when every request failed."""
    import json

    from rich.markup import escape

    from ..audit.determinism import DeterminismRun

    if args.repeat < 2:
        raise ValueError(f"--repeat must be an integer >= 2 (each prompt is sent that many times), got {args.repeat}")
    for flag, value in (("--reference", args.reference), ("--reference-model", args.reference_model)):
        if value is not None:
            raise ValueError(f"--repeat runs the determinism run, which needs no reference: leave out {flag}")
    if args.junit is not None:
        raise ValueError("--junit writes the endpoint audit's cases: leave it out with --repeat (determinism.json "
                         "has the run's verdict per prompt)")
    pairs = read_prompt_set(args.prompts)[: args.limit]
    out = prepare_out(args.out, folder=True)
    try:
        report = DeterminismRun(
            args.endpoint, [t for _, t in pairs], args.repeat, levels, args.model, names=[i for i, _ in pairs],
            tokenizer=args.target, max_tokens=args.max_tokens, api=args.api, stream=args.stream,
            chat_template=args.chat_template, api_key=args.api_key, timeout=args.timeout, progress=True,
        ).run()
    except ConnectionError as e:
        raise ValueError(str(e)) from None
    write_atomic(out / "determinism.json", lambda f: f.write(json.dumps(report.as_dict(), indent=1)))
    write_atomic(out / "determinism.md", lambda f: f.write(report.to_markdown()))
    report.plot(out / "determinism.png")
    _write_html(out / "determinism.html", report)
    console = rich_console()
    spread = [p for p in report.prompts if p["unique"] > 1]
    for p in spread[:10]:
        counts = ", ".join(str(o["count"]) for o in p["outputs"])
        console.print(escape(f"prompt {p['name']}: {p['unique']} unique outputs ({counts} answers), first divergent "
                             f"token {p['first_divergence']}"))
    if len(spread) > 10:
        console.print(f"... {len(spread) - 10} more in determinism.json")
    m = report.meta
    if m["capped"]:
        console.print(escape(m["capped"]))
    console.print(f"{m['requests']} requests ({m['n_prompts']} prompts x {m['repeat']}) at concurrency "
                  f"{', '.join(map(str, m['levels']))} in {m['seconds']:.1f} s")
    console.print(f"wrote {out / 'determinism.json'}, {out / 'determinism.md'}, {out / 'determinism.png'}, "
                  f"{out / 'determinism.html'}")
    status, verdict = report.verdict()
    console.print(escape(verdict) if not status else f"[red]{escape(verdict)}[/red]")
    return status


def _write_html(path, report) -> None:
    """The report as one self-contained HTML page (``batchspec.audit.html``), written whole or not at all."""
    from ..audit.html import audit_html, determinism_html

    page = determinism_html(report) if hasattr(report, "prompts") else audit_html(report)
    write_atomic(path, lambda f: f.write(page))


def _level_line(row, lv: dict) -> str:
    """One level in a line: its signature, its requests (how many failed, and the first error), the counts of the
    other problems, where the tokens came from, the time."""
    sent = f"{lv['requests']} requests"
    if lv["failed"]:
        first = next(p["detail"] for p in lv["problems"] if p["kind"] == "failed")
        sent = f"{lv['failed']} of {sent} failed (first: {first})"
    counts = [f"{lv[key]} {what}" for key, what in (
        ("protocol_errors", "protocol errors"), ("finish_mismatches", "finish_reason mismatches"),
        ("prompt_mismatches", "prompt mismatches"), ("overruns", "overruns"),
        ("unreferenced", "prompts without a reference answer")) if lv.get(key)]
    source = [f"tokens from {lv['token_source']}"] if lv["token_source"] else []
    return "; ".join([f"concurrency {lv['concurrency']}: {row.signature}: {sent}", *counts, *source,
                      f"{lv['seconds']:.1f} s"])


def _run_sampled(args, model, tokenizer, prompts, engines, batch_sizes, sampling, out) -> int:
    from ..audit.core import audit

    report = audit(
        model, resolve_draft(args.target, args.draft), prompts, engines=engines, batch_sizes=batch_sizes,
        num_draft_tokens=args.num_draft_tokens, tokenizer=tokenizer, progress=True, sampling=sampling,
        samples=args.samples, n_tokens=args.n_tokens, alpha=args.alpha,
    )
    _write_reports(out, "distribution", report.as_dict(), report.to_markdown())
    console = rich_console()
    show_table(console, report.rich_table())
    console.print(f"wrote {out / 'distribution.json'}, {out / 'distribution.md'}")
    failed = [e for e, ok in report.engines().items() if not ok and not e.startswith("fault:")]
    if failed:
        console.print(f"[red]not sampling the target's distribution: {', '.join(failed)}[/red]")
        return 1
    return 0


def _write_reports(out, name: str, data: dict, markdown: str) -> None:
    """``name.json`` and ``name.md`` in ``out``, each written whole or not at all (``write_atomic``)."""
    import json

    write_atomic(out / f"{name}.json", lambda f: f.write(json.dumps(data, indent=1)))
    write_atomic(out / f"{name}.md", lambda f: f.write(markdown))
