"""The endpoint audit's flows: what it is asked (``EndpointAudit``, checked as a whole before anything is sent), its
prompts as sent, and the two references: the local oracle (``audit_with_oracle``) or a server at concurrency 1, the
same (``reference="self"``) or another (``audit_with_reference``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ...serve.client import display
from .answer import RETOKENIZED, TOKEN_IDS
from .client import ConcurrentRun, EndpointClient, model_name
from .judges import OracleJudge, ReferenceJudge, compare_level
from .repro import divergence_cases

SELF = "self"  # the reference: the server under test itself, at concurrency 1

TOP_LOGPROBS = 5  # alternatives asked of a reference server at each position (OpenAI's completions allow up to 5)


@dataclass
class EndpointAudit:
    """An endpoint audit's settings (see ``audit_endpoint``); ``run()`` checks them and returns the ``AuditReport``.

    The server: ``url``, ``model`` (None: the first of its ``/v1/models``), ``api``, ``stream``, ``api_key``,
    ``timeout``; what is sent: ``prompts``, ``concurrency`` (the levels), ``max_tokens``, ``stop_token_ids``,
    ``chat_template``. The reference: ``target`` with ``reference`` None (the local oracle: ``dtype``, ``device``,
    ``cache_dir``), or ``reference`` "self" or a URL (``reference_model``, ``top_logprobs``, ``tokenizer``; ``dtype``
    for the tolerance). ``tolerance``: as for ``audit``; ``progress``: show a progress bar. ``capped``: filled in by
    ``checked``, the levels asked for above the number of prompts (each is run at that number, once)."""

    url: str
    target: object = None
    prompts: Sequence = ()
    concurrency: Sequence[int] = (1, 8, 32)
    model: str | None = None
    reference: str | None = None
    reference_model: str | None = None
    tokenizer: object = None
    max_tokens: int = 64
    api: str = "completions"
    stream: bool = False
    chat_template: bool = True
    api_key: str | None = None
    stop_token_ids: Sequence[int] = ()
    tolerance: object = None
    dtype: object = None
    device: object = None
    cache_dir: object = None
    timeout: float = 600.0
    top_logprobs: int = TOP_LOGPROBS
    progress: bool = False
    capped: Sequence[int] = ()

    def checked(self) -> EndpointAudit:
        """These settings with the levels as integers, the prompts as a list and the default reference filled in;
        ``ValueError`` for one that cannot be audited."""
        levels = check_levels(self.concurrency)
        prompts = list(self.prompts)
        if not prompts:
            raise ValueError("no prompts to audit")
        check_request(self.api, self.timeout)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        reference = SELF if self.reference is None and self.target is None else self.reference
        if reference is not None and (not isinstance(reference, str) or not reference.strip()):
            raise ValueError(f"reference must be 'self' or a server's URL, got {reference!r}")
        top = self.top_logprobs
        if not isinstance(top, int) or isinstance(top, bool) or top < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0, got {top!r}")
        levels, capped = cap_levels(levels, len(prompts))
        return replace(self, concurrency=levels, prompts=prompts, reference=reference, capped=capped)

    def run(self):
        """Audit the endpoint (see ``audit_endpoint``)."""
        audit = self.checked()
        model = model_name(audit.url, audit.model, audit.api_key, audit.timeout)
        if audit.reference is None:
            return audit_with_oracle(audit, model)
        return audit_with_reference(audit, model)

    def client(self, url: str, model: str, kind=EndpointClient, **more) -> EndpointClient:
        """A client (of class ``kind``) of the server at ``url`` that sends what this audit sends; ``more``: the rest
        of its fields."""
        return kind(url, model, max_tokens=self.max_tokens, api=self.api, stream=self.stream,
                              api_key=self.api_key, timeout=self.timeout, **more)


def audit_endpoint(url: str, target=None, prompts=(), concurrency=(1, 8, 32), model: str | None = None, **settings):
    """Audit the endpoint at ``url`` at each level of ``concurrency``; returns an ``AuditReport`` with one row per
    level (``batch_size`` = concurrency, engine ``endpoint:<model>``, ``n`` = answers compared, ``outputs`` None for a
    request without one) and ``meta["endpoint"]``: url, model, api, stream, and per level: requests, compared, failed,
    protocol_errors, finish_mismatches, prompt_mismatches, overruns, unreferenced (prompts with no reference answer),
    token_source, seconds and ``problems`` (one ``{prompt, kind, detail}`` per thing wrong with a request: failed,
    protocol error, finish_reason, prompt mismatch, overrun) and ``repro_cases`` (what a reproducer of each divergence
    needs, see ``repro.divergence_cases``). ``settings``: the other fields of ``EndpointAudit``,
    by name.

    The reference (see the package): ``reference=None`` and a ``target``: the local oracle of ``target`` (the same
    model as the server's, loaded locally: a model or a path or a built-in name, as for ``audit``); ``reference=
    "self"`` (the default without a ``target``) or a URL: that server's answers at concurrency 1, no model loaded;
    ``meta["reference"]`` then says what it was (kind, url, model, logprobs, answers, problems, seconds).
    ``reference_model``: the reference server's model id (default: the first of its ``/v1/models``);
    ``top_logprobs``: how many log-probabilities to ask of it per position (0: none, every divergence unattributed).
    ``dtype``: with a reference, the servers' dtype for the tolerance (default float32).

    ``prompts``: strings or token-id lists; with ``api="completions"`` strings are encoded locally when there is a
    tokenizer (through the chat template when ``chat_template`` and the tokenizer has one) and sent as token ids, else
    sent as text; ``api="chat"`` needs strings. ``model``: the server's model id (default: the first of
    ``/v1/models``). ``timeout``: seconds to wait for a server at most, for ``/v1/models`` and for each answer.
    ``cache_dir``: the oracle cache, as for ``audit`` (False: none). Raises ``ConnectionError`` when a server cannot be
    reached."""
    return EndpointAudit(url, target, prompts, concurrency, model, **settings).run()


def check_levels(concurrency) -> list[int]:
    try:
        levels = [int(c) for c in concurrency]
    except (TypeError, ValueError):
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be integers >= 1, got {list(concurrency)}")
    return levels


def cap_levels(levels: list[int], n: int) -> tuple[list[int], list[int]]:
    """``levels`` capped at ``n``, the number of prompts (no more requests can be under way than there are), each
    once; and the levels that were capped."""
    return list(dict.fromkeys(min(c, n) for c in levels)), [c for c in levels if c > n]


def capped_note(capped, n: int) -> str | None:
    """What the report says of the ``capped`` levels (None: none)."""
    return f"concurrency {', '.join(map(str, capped))} capped at {n}, the number of prompts" if capped else None


def check_request(api: str, timeout: float) -> None:
    if api not in ("completions", "chat"):
        raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def encode(prompts, tok, api: str, chat_template: bool) -> tuple[list[list[int]], dict]:
    """The prompts as token ids, and (for ``api="chat"``) the text of each."""
    from batchspec.prompts import encode as encode_text

    if api == "chat":
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("api='chat' needs text prompts")
        if tok is None:
            raise ValueError("api='chat' needs the tokenizer (with its chat template) to build the oracle's prompts")
    ids, texts = [], {}
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                raise ValueError("text prompts need a tokenizer; pass tokenizer= or token-id prompts")
            enc = list(encode_text(tok, [p], chat_template)[0])
            texts[tuple(enc)] = p
            ids.append(enc)
        else:
            ids.append([int(t) for t in p])
    return ids, texts


def reference_tokenizer(target, tokenizer):
    """The tokenizer of an audit without a local model: ``tokenizer`` (an object, a path or a name) or, when it is
    None, ``target`` given as a path or a name; None when neither is given. Only the tokenizer is loaded."""
    from batchspec.model.loading import load_tokenizer

    spec = tokenizer if tokenizer is not None else target
    if spec is None:
        return None
    if not isinstance(spec, (str, os.PathLike)) and not hasattr(spec, "encode"):
        raise ValueError("without a local oracle the target is only read for its tokenizer: give a path or a name "
                         "(or tokenizer=), not a model")
    tok = load_tokenizer(spec)
    if tok is None:
        raise ValueError(f"no tokenizer found for {spec!r}; leave it out to send text prompts as text")
    return tok


def prompt_items(prompts, tok, api: str, chat_template: bool) -> tuple[list, dict]:
    """What is sent for each prompt: its token ids when there is a tokenizer (or the prompt is ids), else its text;
    and (for ``api="chat"``) the text of each id list."""
    if tok is not None:
        return encode(prompts, tok, api, chat_template)
    if api == "chat" and not all(isinstance(p, str) for p in prompts):
        raise ValueError("api='chat' needs text prompts")
    return [p if isinstance(p, str) else [int(t) for t in p] for p in prompts], {}


def run_levels(name, client, items, levels, judge, bar) -> tuple[list, list[dict]]:
    """Every level in turn: its ``AuditRow`` and its summary (``compare_level``), the progress ``bar`` advanced a
    level."""
    from rich.markup import escape

    rows, metas = [], []
    for c in levels:
        bar.describe(escape(f"{name} concurrency {c}"))
        run = ConcurrentRun(client, items, c)
        row, level = compare_level(name, run, run.run(), judge)
        level["repro_cases"] = divergence_cases(run, row.divergences, judge)
        rows.append(row)
        metas.append(level)
        bar.advance()
    return rows, metas


def endpoint_meta(audit: EndpointAudit, model: str, levels_meta) -> dict:
    capped = capped_note(audit.capped, len(audit.prompts))
    return {"url": audit.url, "model": display(model), "api": audit.api, "stream": audit.stream, "levels": levels_meta,
            "retokenized": any(lv["token_source"] and RETOKENIZED in lv["token_source"] for lv in levels_meta),
            "capped": capped}


def audit_with_oracle(audit: EndpointAudit, model: str):
    """The audit against the local oracle of ``audit.target`` (``audit``: checked; ``model``: the server's)."""
    from batchspec.model.loading import eos_ids, load_model, load_tokenizer, vocab_size

    from ...progress import Progress
    from .. import attribution as attr
    from ..inputs import Context
    from ..oracle import Oracle
    from ..report import AuditReport

    target, max_tokens, stop_token_ids = audit.target, audit.max_tokens, audit.stop_token_ids
    model_obj = load_model(target, audit.dtype, audit.device, "target")
    spec = audit.tokenizer if audit.tokenizer is not None else target if isinstance(target, str) else None
    tok = load_tokenizer(spec)
    ids, texts = encode(audit.prompts, tok, audit.api, audit.chat_template)
    stops = sorted(eos_ids(model_obj) | {int(s) for s in stop_token_ids})
    client = audit.client(audit.url, model, tokenizer=tok, stop_token_ids=list(stop_token_ids), texts=texts,
                          stops=stops, vocab_size=vocab_size(model_obj))
    ctx = Context(model_obj, None, tok, 0, max_tokens, [int(s) for s in stop_token_ids])
    name = f"endpoint:{display(model)}"
    oracle = Oracle(model_obj, max_tokens, stops, audit.cache_dir)
    probe = attr.MarginProbe(model_obj)
    rel_tol = attr.relative_tolerance(model_obj.dtype, audit.tolerance)
    try:
        with Progress(audit.progress, len(ids) + len(audit.concurrency), "endpoint audit") as bar:
            bar.describe("oracle (HF greedy, batch size 1)")
            ref = oracle(ids, bar.advance)
            judge = OracleJudge(ids, ref, stops, ctx, probe, rel_tol)
            rows, levels_meta = run_levels(name, client, ids, audit.concurrency, judge, bar)
    finally:
        client.close()
    meta = _oracle_meta(audit, name, model_obj, oracle, ref, stops)
    meta["endpoint"] = endpoint_meta(audit, model, levels_meta)
    return AuditReport(rows, meta, ref)


def _oracle_meta(audit: EndpointAudit, name: str, model_obj, oracle, ref, stops) -> dict:
    """The report's meta of an audit against the local oracle, but for ``endpoint``."""
    from ..core import _tolerance_table
    from ..metrics import repetition_rate

    return {
        "target_fingerprint": oracle.fingerprint, "target_dtype": str(model_obj.dtype).removeprefix("torch."),
        "device": str(model_obj.device), "n_prompts": len(ref), "max_tokens": audit.max_tokens,
        "num_draft_tokens": "-", "stop_ids": stops, "batch_sizes": audit.concurrency,
        "engines": [name], "tolerance": _tolerance_table(audit.tolerance),
        "oracle_repetition_rate": repetition_rate(ref, stops),
        "oracle_cache": {"dir": str(oracle.dir) if oracle.dir else None, "hits": oracle.hits, "misses": oracle.misses},
    }


@dataclass
class _ReferenceRun:
    """What an audit against a reference server sends, and to whom: the prompts as sent (``items``, ``texts``), the
    tokenizer, the reference's URL and model, the stop ids given (the tokenizer's EOS among them)."""

    items: list
    texts: dict
    tok: object
    ref_url: str
    ref_model: str
    given: set


def _reference_run(audit: EndpointAudit, model: str) -> _ReferenceRun:
    tok = reference_tokenizer(audit.target, audit.tokenizer)
    items, texts = prompt_items(audit.prompts, tok, audit.api, audit.chat_template)
    if audit.reference == SELF:
        ref_url, ref_model = audit.url, audit.reference_model or model
    else:
        ref_url = audit.reference
        ref_model = model_name(audit.reference, audit.reference_model, audit.api_key, audit.timeout,
                               "--reference-model")
    given = {int(s) for s in audit.stop_token_ids}
    if getattr(tok, "eos_token_id", None) is not None:
        given.add(int(tok.eos_token_id))
    return _ReferenceRun(items, texts, tok, ref_url, ref_model, given)


def audit_with_reference(audit: EndpointAudit, model: str):
    """The audit against a reference server's answers at concurrency 1 (``audit``: checked; ``model``: the
    server's)."""
    import torch

    from ...progress import Progress
    from .. import attribution as attr
    from ..report import AuditReport

    plan = _reference_run(audit, model)
    common = dict(tokenizer=plan.tok, stop_token_ids=[int(s) for s in audit.stop_token_ids], texts=plan.texts,
                  stops=sorted(plan.given), vocab_size=len(plan.tok) if plan.tok is not None else None)
    ref_client = audit.client(plan.ref_url, plan.ref_model, logprobs=audit.top_logprobs, **common)
    client = audit.client(audit.url, model, **common)
    name = f"endpoint:{display(model)}"
    rel_tol = attr.relative_tolerance(audit.dtype if audit.dtype is not None else torch.float32, audit.tolerance)
    where = "the server itself" if audit.reference == SELF else plan.ref_url
    try:
        with Progress(audit.progress, 1 + len(audit.concurrency), "endpoint audit") as bar:
            bar.describe(f"reference ({where}, concurrency 1)")
            ref_run = ConcurrentRun(ref_client, plan.items, 1)
            ref_answers = ref_run.run()
            bar.advance()
            stops = sorted(plan.given | {a.ids[-1] for a in ref_answers
                                         if a.source == TOKEN_IDS and a.finish_reason == "stop" and a.ids})
            for c in (ref_client, client):
                c.set_stops(stops)
            judge = ReferenceJudge(plan.items, ref_answers, ref_client, stops, audit.max_tokens, rel_tol, client)
            rows, levels_meta = run_levels(name, client, plan.items, audit.concurrency, judge, bar)
    finally:
        client.close()
        ref_client.close()
    meta = _reference_meta(audit, name, plan, judge, ref_run, stops)
    meta["endpoint"] = endpoint_meta(audit, model, levels_meta)
    return AuditReport(rows, meta, list(judge.refs))


def _reference_meta(audit: EndpointAudit, name: str, plan: _ReferenceRun, judge: ReferenceJudge,
                    ref_run: ConcurrentRun, stops) -> dict:
    """The report's meta of an audit against a reference server, but for ``endpoint``."""
    from .. import metrics

    refs = [r for r in judge.refs if r is not None]
    lps = judge.logprobs_status(audit.top_logprobs)
    where = ("the same server at concurrency 1" if audit.reference == SELF
             else f"{plan.ref_url} (model {display(plan.ref_model)}) at concurrency 1")
    dname = str(audit.dtype).removeprefix("torch.") if audit.dtype is not None else "float32"
    return {
        "target_fingerprint": None, "target_dtype": dname, "device": None, "n_prompts": len(plan.items),
        "max_tokens": audit.max_tokens, "num_draft_tokens": "-", "stop_ids": stops,
        "batch_sizes": audit.concurrency, "engines": [name],
        "tolerance": {"relative": judge.rel_tol, "dtype": dname, "basis": "logprobs"},
        "oracle": f"{where}; divergences attributed from its logprobs ({lps})",
        "oracle_repetition_rate": metrics.repetition_rate(refs, stops) if refs else 0.0,
        "oracle_cache": None,
        "reference": {"kind": SELF if audit.reference == SELF else "endpoint", "url": plan.ref_url,
                      "model": display(plan.ref_model), "api": audit.api, "stream": audit.stream,
                      "top_logprobs": audit.top_logprobs, "logprobs": lps, "answers": len(refs),
                      "requests": len(plan.items), "problems": judge.problems,
                      "token_source": ", ".join(sorted({a.source for a in ref_run.answers if a.source})) or None,
                      "stops_learned": sorted(set(stops) - plan.given), "seconds": ref_run.seconds,
                      "tokenizer": plan.tok is not None},
    }
