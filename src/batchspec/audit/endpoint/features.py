"""The endpoint audit's feature matrix (``batchspec audit --endpoint URL --features ...``): the request fields beyond
plain greedy decoding (``FEATURES``), each sent at concurrency 1 and at the audit's highest level and compared with a
reference's answers to the same requests (another server, or the server itself at concurrency 1), with a check of
its own per feature:

- ``json``: ``response_format`` json_schema (``SCHEMA``): the answer is JSON that follows it (its required keys and
  their types);
- ``tools``: ``tools`` with a named ``tool_choice``: a tool call of that function whose arguments follow ``SCHEMA``;
- ``penalties``: presence and frequency penalties: exactness only;
- ``logit_bias``: +100 on a token of the reference's plain answer other than its first: the answer starts with it;
- ``stop``: a stop string cut from the middle of the reference's plain text: the answer does not hold it and ends
  with ``finish_reason`` ``"stop"``;
- ``logprobs``: ``logprobs`` with ``top_logprobs``: ``logprob_checks.answer_faults`` (finite, <= 0, the returned
  token the most likely listed at temperature 0), where the answer has token ids;
- ``n``: ``n=2`` greedy: two choices, equal to each other (and, for exactness, to the reference's);
- ``seed``: sampled (``SEED_TEMPERATURE``) with a fixed seed, each prompt sent twice: whether the two agree
  (``deterministic``). A server need not honour a seed across concurrency, so this feature never fails the audit.

Requests go to the chat API (tools exist only there), unstreamed, with ``return_token_ids``: the output compared is
the token ids when both answers have them, else the text (or the tool calls). An HTTP 400 to every request of a
feature at a level (or to the reference's) makes it ``unsupported`` there, not a failure. A cell (feature x level)
is the first of ``unsupported``, ``could not audit`` (every request failed, or every JSON answer or tool call was
cut short by ``max_tokens``: the audit's limit, not a fault), ``invalid``, ``inexact``,
``incomplete`` (some requests failed or had no reference answer), ``clean``; for ``seed``: ``deterministic`` or
``not deterministic`` instead of the last four."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ...serve.client import (api_base, auth_headers, choice_text, choices, display, one_line, read_body,
                             run_within)
from .logprob_checks import answer_faults, positions

FEATURES = ("json", "tools", "penalties", "logit_bias", "stop", "logprobs", "n", "seed")
CLEAN, INEXACT, INVALID, INCOMPLETE = "clean", "inexact", "invalid", "incomplete"
CUT = "cut"  # an answer max_tokens ended before its feature's check could judge it
UNSUPPORTED, COULD_NOT_AUDIT = "unsupported", "could not audit"
DETERMINISTIC, NOT_DETERMINISTIC = "deterministic", "not deterministic"
UNCHECKED = "unchecked"  # an answer whose feature has no check, or that lacks what the check needs
FAILING = (INEXACT, INVALID, INCOMPLETE)  # the statuses that fail the audit (exit status 1)

SCHEMA = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"type": "string", "maxLength": 3}}}
TOOL = {"type": "function", "function": {"name": "get", "description": "a number and a word", "parameters": SCHEMA}}
BIAS = 100  # the logit bias that forces its token at temperature 0
TOP_LOGPROBS = 5
SEED, SEED_TEMPERATURE = 1234, 0.8
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5}
TYPES = {"integer": int, "string": str, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def parse_features(text: str) -> list[str]:
    """``--features``: a comma list of ``FEATURES``, or ``all``; ``ValueError`` for an unknown name."""
    names = [f.strip() for f in text.split(",") if f.strip()]
    if names == ["all"]:
        return list(FEATURES)
    unknown = [f for f in names if f not in FEATURES]
    if unknown or not names:
        raise ValueError(f"--features takes a comma list of {', '.join(FEATURES)} or all, got {text!r}")
    return list(dict.fromkeys(names))


def schema_problem(value) -> str | None:
    """Why ``value`` does not follow ``SCHEMA`` (its required keys, their types and no others), or None."""
    if not isinstance(value, dict):
        return f"not a JSON object: {one_line(json.dumps(value), 80)}"
    props = SCHEMA["properties"]
    missing = [k for k in SCHEMA["required"] if k not in value]
    extra = [k for k in value if k not in props]
    if missing or extra:
        return f"keys {sorted(value)}, not the schema's {sorted(props)}"
    for key, spec in props.items():
        v = value[key]
        if not isinstance(v, TYPES[spec["type"]]) or (isinstance(v, bool) and spec["type"] != "boolean"):
            return f"{key} is {one_line(json.dumps(v), 40)}, not of type {spec['type']}"
    return None


@dataclass
class Reply:
    """One answer to a feature request: its HTTP ``status`` (0: none), its ``choices`` and why it failed (``error``,
    None when it did not)."""

    status: int = 0
    choices: list = field(default_factory=list)
    error: str | None = None


def output(choice: dict):
    """What a choice's exactness is judged on: its token ids when it has them, else its text or its tool calls."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return ("ids", ids)
    calls = (choice.get("message") or {}).get("tool_calls")
    if calls:
        return ("text", json.dumps([(c.get("function") or {}) for c in calls if isinstance(c, dict)], sort_keys=True))
    return ("text", choice_text(choice))


def same(a: dict, b: dict) -> bool:
    """Two choices agree: on token ids when both have them, else on their text (or tool calls)."""
    x, y = output(a), output(b)
    if x[0] != y[0]:
        x, y = output({k: v for k, v in a.items() if k != "token_ids"}), output(
            {k: v for k, v in b.items() if k != "token_ids"})
    return x == y


def _tool_problem(choice: dict) -> str | None:
    calls = (choice.get("message") or {}).get("tool_calls")
    if not isinstance(calls, list) or not calls or not isinstance(calls[0], dict):
        return "no tool_calls in the answer"
    fn = calls[0].get("function") or {}
    if fn.get("name") != TOOL["function"]["name"]:
        return f"the call names {display(fn.get('name'))!r}, not {TOOL['function']['name']!r}"
    try:
        return schema_problem(json.loads(fn.get("arguments")))
    except (TypeError, ValueError):
        return f"the arguments are not JSON: {display(fn.get('arguments'))}"


def _json_problem(choice: dict) -> str | None:
    try:
        return schema_problem(json.loads(choice_text(choice)))
    except (TypeError, ValueError):
        return f"the answer is not JSON: {display(choice_text(choice))}"


def _stop_problem(choice: dict, stop: str) -> str | None:
    text = choice_text(choice)
    if not isinstance(text, str) or stop in text:
        return f"the answer holds the stop string {stop!r}: {display(text)}"
    if choice.get("finish_reason") != "stop":
        return f"finish_reason {display(choice.get('finish_reason'))!r}, not 'stop'"
    return None


def _bias_problem(choice: dict, token: int) -> str | None:
    ids = choice.get("token_ids")
    if not isinstance(ids, list):
        return UNCHECKED
    return None if ids[:1] == [token] else f"the answer starts with {ids[:1]}, not the biased token {token}"


def _logprob_problem(choice: dict, rel_tol: float) -> str | None:
    ids = choice.get("token_ids")
    pos = positions([(ids, choice.get("logprobs"))], ids) if isinstance(ids, list) and ids else None
    if pos is None:
        return UNCHECKED  # without token ids the values cannot be matched to tokens
    faults, _ = answer_faults(pos, rel_tol)
    return "; ".join(faults) or None


def problem(feature: str, reply: Reply, plan: dict, rel_tol: float) -> str | None:
    """Why an answer fails its feature's check: None when it passes, ``UNCHECKED`` when the feature has no check or
    the answer lacks what it needs (token ids), ``CUT`` for a JSON answer or tool call that ``max_tokens`` ended
    before it could be whole (the audit's own limit, not the server's fault)."""
    first = reply.choices[0]
    if feature in ("json", "tools"):
        why = _json_problem(first) if feature == "json" else _tool_problem(first)
        return CUT if why is not None and first.get("finish_reason") == "length" else why
    if feature == "stop":
        return _stop_problem(first, plan["stop"])
    if feature == "logit_bias":
        return _bias_problem(first, plan["token"])
    if feature == "logprobs":
        return _logprob_problem(first, rel_tol)
    if feature == "n":
        if len(reply.choices) != 2:
            return f"{len(reply.choices)} choices, not 2"
        return None if same(*reply.choices) else "the two choices differ at temperature 0"
    return UNCHECKED


def plan_of(feature: str, plain: Reply | None) -> dict | None:
    """What a prompt's request of ``feature`` needs from the reference's plain answer (``plain``): the stop string,
    the biased token. None when that answer failed; ``{"skip": why}`` when it cannot give one (too short, no token
    ids): the prompt is then not sent, and not counted against the server."""
    if feature not in ("stop", "logit_bias"):
        return {}
    if plain is None or plain.error is not None:
        return None
    c = plain.choices[0]
    if feature == "stop":
        text = choice_text(c)
        k = len(text) // 2 if isinstance(text, str) else 0
        stop = text[k:k + 3].strip() if k else ""
        return {"stop": stop} if stop else {"skip": "the reference's plain answer is too short to cut a stop string"}
    ids = c.get("token_ids") if isinstance(c.get("token_ids"), list) else []
    body = ids[:-1] if c.get("finish_reason") == "stop" else ids  # not the stop token
    pick = [t for t in body if t != ids[0]] or body
    return {"token": pick[0]} if pick else {"skip": "the reference's plain answer has no token ids to bias"}


def body(feature: str, model: str, prompt: str, plan: dict, max_tokens: int) -> dict:
    """The chat request of ``feature`` for ``prompt``."""
    b = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
         "temperature": 0, "return_token_ids": True, "stream": False}
    if feature == "json":
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "audit", "schema": SCHEMA}}
    elif feature == "tools":
        b.update(tools=[TOOL], tool_choice={"type": "function", "function": {"name": TOOL["function"]["name"]}})
    elif feature == "penalties":
        b.update(PENALTIES)
    elif feature == "logit_bias":
        b["logit_bias"] = {str(plan["token"]): BIAS}
    elif feature == "stop":
        b["stop"] = [plan["stop"]]
    elif feature == "logprobs":
        b.update(logprobs=True, top_logprobs=TOP_LOGPROBS, return_tokens_as_token_ids=True)
    elif feature == "n":
        b["n"] = 2
    elif feature == "seed":
        b.update(temperature=SEED_TEMPERATURE, seed=SEED)
    return b


@dataclass
class Sender:
    """Sends feature requests to one server's chat API, each answer read whole within ``timeout`` seconds."""

    url: str
    model: str
    api_key: str | None = None
    timeout: float = 600.0

    def __post_init__(self):
        import httpx

        self.http = httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_connections=None))

    def close(self):
        self.http.close()

    def _exchange(self, b: dict, deadline: float) -> tuple[int, bytes]:
        url = api_base(self.url) + "/chat/completions"
        with self.http.stream("POST", url, json=b, headers=auth_headers(self.api_key)) as r:
            return r.status_code, read_body(r, deadline)

    def send(self, b: dict) -> Reply:
        """One request's ``Reply``; never raises for what the server does."""
        try:
            status, data = run_within(self.timeout, self._exchange, b, time.monotonic() + self.timeout)
        except Exception as e:  # the transport, the deadline, the size limit
            return Reply(error=one_line(f"{type(e).__name__}: {e}") if not isinstance(e, TimeoutError)
                         else f"no answer within {self.timeout:g} s (the timeout)")
        text = data.decode(errors="replace")
        if status != 200:
            return Reply(status, error=one_line(f"HTTP {status}: {text}"))
        try:
            return Reply(status, choices(json.loads(text)))
        except Exception as e:  # not JSON, no choice
            return Reply(status, error=one_line(f"the answer is not read: {e}"))

    def level(self, bodies: list, concurrency: int) -> list[Reply | None]:
        """Every request of ``bodies`` (None: not sent) with ``concurrency`` under way at once."""
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(lambda b: None if b is None else self.send(b), bodies))


@dataclass
class Cell:
    """One feature at one level: counts, the first problems, and its status (see the module). ``checked``: answers
    that the feature's own check could judge, ``valid`` of them passed; ``pairs`` (seed): prompts with both answers,
    ``agreeing`` of them equal."""

    feature: str
    concurrency: int
    requests: int = 0
    failed: int = 0
    refused: int = 0
    unreferenced: int = 0
    not_applicable: int = 0
    compared: int = 0
    exact: int = 0
    checked: int = 0
    valid: int = 0
    pairs: int = 0
    agreeing: int = 0
    cut: int = 0
    problems: list = field(default_factory=list)
    status: str = CLEAN

    def note(self, prompt: int, kind: str, detail: str) -> None:
        if len(self.problems) < 20:
            self.problems.append({"prompt": prompt, "kind": kind, "detail": detail})

    def settle(self, reference_refused: bool) -> Cell:
        """Fill in ``status`` from the counts."""
        answered = self.requests - self.failed - self.refused
        if reference_refused or (self.requests and self.refused == self.requests):
            self.status = UNSUPPORTED
        elif not answered or not self.compared:
            self.status = COULD_NOT_AUDIT
        elif self.feature == "seed":
            self.status = DETERMINISTIC if self.pairs and self.agreeing == self.pairs else NOT_DETERMINISTIC
        elif self.cut and not self.checked:  # every answer cut short: nothing judged
            self.status = COULD_NOT_AUDIT
        elif self.valid < self.checked:
            self.status = INVALID
        elif self.exact < self.compared:
            self.status = INEXACT
        elif self.failed or self.refused or self.unreferenced:
            self.status = INCOMPLETE
        return self

    def add(self, i: int, reply: Reply) -> bool:
        """Count prompt ``i``'s ``reply`` as sent; whether it was answered."""
        self.requests += 1
        if reply.error is None:
            return True
        if reply.status == 400:
            self.refused += 1
        else:
            self.failed += 1
        self.note(i, "unsupported" if reply.status == 400 else "failed", reply.error)
        return False

    def judge(self, i: int, reply: Reply, ref: Reply | None, plan: dict, rel_tol: float) -> None:
        """Judge an answered ``reply`` against the reference's (``ref``) and the feature's own check."""
        if ref is None or ref.error is not None:
            self.unreferenced += 1
            self.note(i, "no reference", ref.error if ref is not None else "no reference answer")
        else:
            self.compared += 1
            if len(reply.choices) == len(ref.choices) and all(map(same, reply.choices, ref.choices)):
                self.exact += 1
            else:
                self.note(i, "inexact", f"the answer differs from the reference's: {_shown(reply)} where the "
                                        f"reference has {_shown(ref)}")
        why = problem(self.feature, reply, plan, rel_tol)
        if why == CUT:
            self.cut += 1
            self.note(i, "cut", "max_tokens ended the answer first: a larger --max-tokens may let it finish")
        elif why != UNCHECKED:
            self.checked += 1
            self.valid += why is None
            if why is not None:
                self.note(i, "invalid", why)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["exact_rate"] = self.exact / self.compared if self.compared else None
        return d


def _shown(reply: Reply) -> str:
    return display(json.dumps(output(reply.choices[0])[1]), 60)


@dataclass
class FeatureMatrix:
    """The feature matrix's settings; ``run()`` sends it and returns its results (``as_dict`` of each ``Cell``, the
    verdict). ``reference``: None (the server itself at concurrency 1) or a URL, with ``reference_model``;
    ``levels``: the concurrency levels (1 and the audit's highest); ``rel_tol``: the logprob check's tolerance."""

    url: str
    model: str
    prompts: list
    features: list
    levels: list
    reference: str | None = None
    reference_model: str | None = None
    max_tokens: int = 64
    api_key: str | None = None
    timeout: float = 600.0
    rel_tol: float = 1e-5

    def run(self) -> dict:
        if not all(isinstance(p, str) for p in self.prompts):
            raise ValueError("the feature matrix sends chat messages: give text prompts")
        server = Sender(self.url, self.model, self.api_key, self.timeout)
        ref = server if self.reference is None else Sender(self.reference, self.reference_model or self.model,
                                                           self.api_key, self.timeout)
        try:
            plain = None
            if {"stop", "logit_bias"} & set(self.features):  # the reference's plain answers give their settings
                plain = ref.level([body("plain", ref.model, p, {}, self.max_tokens) for p in self.prompts], 1)
            cells = [c for f in self.features for c in self._feature(f, server, ref, plain)]
        finally:
            server.close()
            if ref is not server:
                ref.close()
        status, verdict = matrix_verdict([c.as_dict() for c in cells])
        return {"features": list(self.features), "levels": list(self.levels), "api": "chat",
                "reference": "the server itself at concurrency 1" if self.reference is None else
                f"{self.reference} at concurrency 1", "cells": [c.as_dict() for c in cells], "status": status,
                "verdict": verdict}

    def _feature(self, feature: str, server: Sender, ref: Sender, plain) -> list[Cell]:
        """One feature: the reference's answers, then each level's, judged."""
        plans = [plan_of(feature, p) for p in plain] if plain is not None else [{} for _ in self.prompts]

        def bodies(sender):
            return [None if plan is None or "skip" in plan else body(feature, sender.model, p, plan, self.max_tokens)
                    for p, plan in zip(self.prompts, plans)]

        refs = ref.level(bodies(ref), 1)
        sent = [r for r in refs if r is not None]
        refused = bool(sent) and all(r.status == 400 for r in sent)
        times = 2 if feature == "seed" else 1  # seed: each prompt twice, the copies in different company
        return [self._level(feature, c, server.level(bodies(server) * times, c), refs, plans).settle(refused)
                for c in self.levels]

    def _level(self, feature: str, c: int, replies: list, refs: list, plans: list) -> Cell:
        cell, n = Cell(feature, c), len(plans)
        for i, plan in enumerate(plans):
            if plan is None or "skip" in plan:
                cell.unreferenced += plan is None
                cell.not_applicable += plan is not None
                cell.note(i, "no reference" if plan is None else "not applicable",
                          plan["skip"] if plan else "the reference's plain answer failed")
                continue
            got = [r for r in replies[i::n] if cell.add(i, r)]
            if got:
                cell.judge(i, got[0], refs[i], plan, self.rel_tol)
            if feature == "seed" and len(got) == 2:
                cell.pairs += 1
                cell.agreeing += same(got[0].choices[0], got[1].choices[0])
        return cell


def matrix_verdict(cells: list[dict]) -> tuple[int, str]:
    """The feature matrix's exit status and verdict in a line: 1 when a supported feature is ``inexact``,
    ``invalid`` or ``incomplete`` at a level, else 2 when one could not be audited, else 0. ``seed`` never fails it
    (a server need not honour a seed across concurrency); ``unsupported`` neither."""
    def where(statuses):
        return [f"{c['feature']} at concurrency {c['concurrency']} ({c['status']})" for c in cells
                if c["status"] in statuses and c["feature"] != "seed"]

    if where(FAILING):
        return 1, f"features not clean: {', '.join(where(FAILING))}"
    if where((COULD_NOT_AUDIT,)):
        return 2, f"features not audited: {', '.join(where((COULD_NOT_AUDIT,)))}"
    clean = sorted({c["feature"] for c in cells if c["status"] in (CLEAN, DETERMINISTIC, NOT_DETERMINISTIC)})
    return 0, f"features clean: {', '.join(clean) or 'none supported'}"


def table_rows(result: dict) -> list[list]:
    """One row per cell for the reports: feature, concurrency, status, exact, valid, requests, failed,
    unsupported (HTTP 400), no reference, not applicable."""
    def ratio(k, n):
        return f"{k}/{n}" if n else "-"

    return [[c["feature"], c["concurrency"], c["status"], ratio(c["exact"], c["compared"]),
             ratio(c["agreeing"], c["pairs"]) if c["feature"] == "seed" else ratio(c["valid"], c["checked"]),
             c["requests"], c["failed"], c["refused"], c["unreferenced"], c["not_applicable"]]
            for c in result["cells"]]


TABLE_HEAD = ["feature", "concurrency", "status", "exact", "valid (seed: agreeing)", "requests", "failed",
              "unsupported (HTTP 400)", "no reference", "not applicable"]
