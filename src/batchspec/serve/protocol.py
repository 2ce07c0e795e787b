"""The OpenAI wire format: request validation (``parse_completion``, ``parse_chat``), OpenAI-style errors
(``APIError``), incremental detokenisation with stop strings (``TextStream``) and the JSON bodies of responses and
stream chunks. Plain Python: nothing here needs the web framework.

Field rules (OpenAI's, plus the vLLM extensions ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``
and ``return_tokens_as_token_ids``):

- ``prompt`` (completions): a string, a list of token ids, or a list of up to ``MAX_PROMPTS`` of either (each prompt
  a request of its own, answered together: prompt i's choice j is choice ``i * n + j``; not with ``stream``);
  ``messages`` (chat):
  ``{"role", "content"}`` objects whose content is a string or a list of ``{"type": "text", "text"}`` parts, rendered
  with the tokenizer's chat template;
- ``max_tokens`` (chat also ``max_completion_tokens``) >= 1; default 16 for completions (as OpenAI) and the server's
  ``default_max_tokens`` for chat, both clipped to what fits the context; prompt + ``max_tokens`` beyond the context is
  an error;
- ``temperature`` finite in [0, 10^4] (0: greedy, token-for-token equal to batch-size-1 greedy decoding; default: the
  server's ``default_temperature``, 1.0 as OpenAI), ``top_p`` in (0, 1], ``top_k`` in [0, 2**31) (0 or -1: off),
  ``seed`` an integer in [-2**63, 2**63): the bounds of ``SamplingParams``, which checks them;
- ``stop``: a string or a list of non-empty strings of at most 256 characters (the text ends before the first match;
  needs a tokenizer); ``stop_token_ids``: token ids that end the output (kept in ``token_ids``, as the model's EOS);
- text (a prompt, message contents, stop strings) must be valid Unicode (no lone surrogates such as ``"\ud800"``);
  a text prompt of more than ``MAX_CHARS_PER_TOKEN`` characters a position of the context is refused before it is
  tokenised, a prompt of token ids longer than the context before its ids are checked;
- ``n`` in [1, ``MAX_N``]: n choices, choice i sampled with ``seed + i`` when a seed is given;
- log-probabilities: completions ``logprobs`` an integer in [0, ``MAX_LOGPROBS``] (the alternatives at each
  position), chat ``logprobs: true`` with ``top_logprobs`` in [0, ``MAX_LOGPROBS``] (``top_logprobs`` needs
  ``logprobs``); ``return_tokens_as_token_ids`` renders their tokens as ``"token_id:<id>"``;
- logits processors (``SamplingParams``' bounds): ``presence_penalty`` and ``frequency_penalty`` in [-2, 2],
  ``logit_bias`` (token id, as a string -> bias in [-100, 100]), and vLLM's ``min_p``, ``repetition_penalty``,
  ``min_tokens``;
- structured output: ``response_format`` ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"schema": ...}}``, or vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``); a schema,
  regex or grammar that does not compile, or that no token of the vocabulary can begin, is refused (400);
- ``echo`` (completions): the prompt's text before the output and, with ``logprobs``, the prompt tokens' entries first
  (None for the first token); ``max_tokens: 0`` then returns the prompt alone. ``prompt_logprobs`` (vLLM's, both
  endpoints, in [0, ``MAX_LOGPROBS``]): per prompt token None first, then ``{id: {logprob, rank, decoded_token}}``.
  Neither with ``stream``;
- ``tools`` (chat) with ``tool_choice`` ``auto`` (the default), ``none``, ``required`` or a named function: the tools
  go to the chat template; ``required`` or a named function constrains the output to a ``{"name", "arguments"}``
  object whose arguments match the function's ``parameters``; an output that is a call (also in ``<tool_call>`` tags)
  is answered as ``message.tool_calls`` with finish reason ``tool_calls``. Messages may hold ``role: "tool"`` answers
  and assistant ``tool_calls``. Not with ``stream`` (unless ``tool_choice`` is ``none``);
- ``suffix``, ``best_of`` > 1 and the legacy ``functions`` are refused (400).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
import time
import uuid
from dataclasses import dataclass, field

from ..params import (MAX_TOKENS, PROCESSORS, ParamError, SamplingParams, check_prompt_logprobs, check_sampling,
                      check_structured, show)
from ..text import TextStream  # noqa: F401  (the server's stop strings, shared with LLM.generate)

# The largest request body by default (413 beyond): a full context of 128k tokens, as ids or as escaped text, takes
# about 1 MB.
DEFAULT_MAX_BODY_BYTES = 4 * 2**20

# while rows run, a prompt with more tokens not kept yet is prefilled this many a step before it joins: ~1.5 s of
# prefill for the default model on 2 cores, so a stream waits about that long, not the whole prompt's prefill, when a
# long prompt arrives. Shorter prompts join whole, up to PREFILL_TOKENS a step
PREFILL_CHUNK = 2048
# while rows run, the prompt tokens of the whole requests a step prefills at most (at least one joins): a burst of
# arrivals is prefilled a group at a time, each group streaming before the next one's prefill. 16 clients, 64
# Spec-Bench prompts of ~430 tokens, 32 tokens each, against no bound (2-core EPYC, two sittings of two pairs): output
# tok/s 1.13x, 1.19x, 0.91x, 1.04x; each prompt sent twice 1.03x, 1.07x; multi-turn 1.06x, 1.05x. 1024: lower TTFTs
# still, at 0.92-1.05x the tok/s
PREFILL_TOKENS = 2048

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256  # each stop string; the held-back text is checked against every prefix of each stop string
# A text prompt longer than this many characters for each position of the context cannot fit it: refused before it is
# tokenised (real text runs 3-5 characters a token; 32 leaves room for long runs of spaces or symbols).
MAX_CHARS_PER_TOKEN = 32
INT64 = 2**63
# Choices one request may ask for (``n``): each is a row of the engine's batch, so the bound keeps one request from
# taking more than a batch's worth of rows.
MAX_N = 16
# Prompts one completions request may send as a list (each takes at least one row of the engine's batch).
MAX_PROMPTS = 64
# The log-probability sent for a token the model gives probability 0 (JSON has no -Infinity), as OpenAI and vLLM do.
MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


DONE = "[DONE]"


def sse_data(line: str):
    """A Server-Sent Events line as a client reads it: None (not a data line), ``DONE`` (the end of the stream) or
    the event's JSON object."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    return DONE if data == DONE else json.loads(data)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


@dataclass
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str
    vocab_size: int
    context: int | None  # most positions (prompt + output) a request may use; None: unlimited
    tokenizer: object = None
    default_max_tokens: int = 256
    default_temperature: float = 1.0
    grammars: object = None  # ``batch.grammar.Grammars``: checks that a grammar can begin with this vocabulary


@dataclass
class GenRequest:
    """A validated request: the prompt's token ids and the sampling settings."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    n: int = 1  # choices
    logprobs: int | None = None  # alternatives at each position (None: no log-probabilities)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    cache_salt: str | None = None  # prompts share cached prefixes only with prompts of the same salt
    processors: dict = field(default_factory=dict)  # the logits processors' checked fields (``PROCESSORS``' names)
    echo: bool = False  # completions: the prompt (text, and log-probabilities with ``logprobs``) before the output
    prompt_text: str | None = None  # the prompt as sent when it was text (echoed as it is)
    prompt_logprobs: int | None = None  # vLLM's: alternatives at each prompt position (None: not asked for)

    @property
    def prompt_alternatives(self) -> int | None:
        """The alternatives the engine computes at each prompt position (``echo`` with ``logprobs`` asks too)."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None
    structured: dict = field(default_factory=dict)  # the structured-output field, by ``SamplingParams``' name
    tools: list[dict] = field(default_factory=list)  # chat: the functions an output may call (``tool_calls``)


# ------------------------------------------------------------------------------------------------ field readers


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _whole(v):
    """A JSON number that is a whole float (``16.0``) as an ``int``; anything else as it is."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _get_int(body: dict, name: str):
    v = _whole(body.get(name))
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"{name} must be an integer, got {show(v)}", name)
    return int(v)


def _get_real(body: dict, name: str):
    v = body.get(name)
    if v is None:
        return None
    if not _is_real(v) or v != v:
        raise bad(f"{name} must be a number, got {show(v)}", name)
    return float(v)


def _get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {show(v)}", name)
    return v


def _refuse_unsupported(body: dict, kind: str) -> None:
    if body.get("stream") is True:
        for name in ("echo", "prompt_logprobs"):
            if body.get(name) not in (None, False):
                raise bad(f"{name} is not supported with stream", name, "unsupported_parameter")
    if kind == "completion":
        if body.get("suffix"):
            raise bad("suffix is not supported by this server", "suffix", "unsupported_parameter")
        if body.get("best_of") not in (None, 1):
            raise bad("best_of other than 1 is not supported by this server", "best_of", "unsupported_parameter")
    else:
        for name in ("functions", "function_call"):
            if body.get(name):
                raise bad(f"{name} is not supported by this server: use tools", name, "unsupported_parameter")


def _choices(body: dict) -> int:
    n = _whole(body.get("n"))
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad(f"n must be an integer in [1, {MAX_N}] (the choices to generate), got {show(n)}", "n")
    return int(n)


def _logprobs(body: dict, kind: str):
    """The alternatives asked for at each position, None when no log-probabilities are asked for (its range is
    ``check_sampling``'s). Completions: ``logprobs: <int>``; chat: ``logprobs: true`` and ``top_logprobs: <int>``
    (0 when left out)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if kind == "completion":
        if top is not None:
            raise bad("top_logprobs is a chat field; on /v1/completions give logprobs: <number of alternatives>",
                      "top_logprobs")
        return None if lp is None or lp is False else _whole(lp)
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"logprobs must be true or false (give the alternatives as top_logprobs), got {show(lp)}",
                  "logprobs")
    if not lp:
        if top not in (None, 0):
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return 0 if top is None else _whole(top)


def _model(body: dict, info: ModelInfo) -> str:
    name = body.get("model")
    if name is None:
        return info.name
    if not isinstance(name, str) or name != info.name:
        raise bad(f"the model {show(name)} does not exist; this server serves {info.name!r}", "model",
                  "model_not_found")
    return name


def _fits(n: int, info: ModelInfo, param: str) -> None:
    """A prompt of ``n`` tokens must leave room for one generated token."""
    if info.context is not None and n >= info.context:
        raise bad(f"the prompt has {n} tokens; the model's context of {info.context} positions leaves no room for "
                  "output", param, "context_length_exceeded")


def _check_ids(ids, info: ModelInfo, param: str) -> list[int]:
    if not ids:
        raise bad(f"{param} is empty", param)
    _fits(len(ids), info, param)  # before looking at a million ids
    for t in ids:
        if not _is_int(t):
            raise bad(f"{param} must hold integer token ids, got {show(t)}", param)
        if not 0 <= t < info.vocab_size:
            raise bad(f"token id {t} in {param} is outside the vocabulary (0..{info.vocab_size - 1})", param,
                      "invalid_token_id")
    return [int(t) for t in ids]


def _unicode(text: str, param: str) -> str:
    """``text`` unless it holds a lone surrogate (JSON's ``"\ud800"``), which no tokenizer or UTF-8 output takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"{param} is not valid Unicode: it holds a lone surrogate ({show(text[e.start : e.end])} at "
                  f"character {e.start})", param) from None
    return text


def _short_enough(chars: int, info: ModelInfo, param: str) -> None:
    """Text too long to fit the context whatever it tokenises to: refused before tokenising (which takes seconds and
    gigabytes on megabytes of text)."""
    if info.context is not None and chars > info.context * MAX_CHARS_PER_TOKEN:
        raise bad(f"{param} has {chars} characters, more than the model's context of {info.context} positions can "
                  f"hold (at most {MAX_CHARS_PER_TOKEN} characters a position)", param, "context_length_exceeded")


def _encode_text(text: str, info: ModelInfo, param: str) -> list[int]:
    if info.tokenizer is None:
        raise bad(f"this model has no tokenizer: send {param} as a list of token ids", param)
    if not text:
        raise bad(f"{param} is empty", param)
    _short_enough(len(text), info, param)
    _unicode(text, param)
    ids = list(info.tokenizer(text)["input_ids"])
    if not ids:
        raise bad(f"{param} encodes to no tokens", param)
    _fits(len(ids), info, param)
    return ids


def _prompt_ids(body: dict, info: ModelInfo) -> list[int]:
    p = body.get("prompt")
    if p is None:
        raise bad("prompt is missing", "prompt")
    if isinstance(p, list) and len(p) == 1 and not _is_int(p[0]):  # a list of one prompt (``split_prompts``)
        p = p[0]
    if isinstance(p, str):
        return _encode_text(p, info, "prompt")
    if isinstance(p, list):
        return _check_ids(p, info, "prompt")
    raise bad(f"prompt must be a string or a list of token ids, got {type(p).__name__}", "prompt")


def split_prompts(body) -> list:
    """A completions body as one body per prompt: ``prompt`` may be a list of prompts (strings or lists of token ids,
    as lm-eval's batches send them), each then validated and run as a request of its own (``merge`` answers them as
    one). Not with ``stream``."""
    p = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(p, list) or len(p) < 2 or _is_int(p[0]):
        return [body]
    if len(p) > MAX_PROMPTS:
        raise bad(f"at most {MAX_PROMPTS} prompts a request, got {len(p)}", "prompt")
    if body.get("stream") is True:
        raise bad("a list of prompts is not streamed by this server: send one prompt per streamed request", "prompt",
                  "unsupported_parameter")
    return [{**body, "prompt": q} for q in p]


def merge(bodies: list[dict], n: int) -> dict:
    """The answers of ``split_prompts``' bodies (of ``n`` choices each) as one: prompt i's choice j is choice
    ``i * n + j`` (OpenAI's order), ``usage`` adds up every prompt's."""
    choices = [{**c, "index": i * n + c["index"]} for i, b in enumerate(bodies) for c in b["choices"]]
    counts = [sum(b["usage"][k] for b in bodies) for k in ("prompt_tokens", "completion_tokens")]
    return {**bodies[0], "choices": choices, "usage": usage(*counts)}


ROLES = ("system", "user", "assistant", "developer", "tool")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages is missing", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] must be an object with a role in {', '.join(ROLES)}", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                              "unsupported_parameter")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        out.append({"role": m["role"], "content": _unicode(content, f"messages[{i}].content"), **_tool_fields(m, i)})
    return out


def _tool_fields(m: dict, i: int) -> dict:
    """What a tool's answer (``tool_call_id``, ``name``) or an assistant's ``tool_calls`` add to a message, the
    calls' arguments as objects (chat templates render them as such; the wire sends JSON text)."""
    out = {k: m[k] for k in ("tool_call_id", "name") if m["role"] == "tool" and isinstance(m.get(k), str)}
    calls = m.get("tool_calls")
    if calls is None:
        return out
    param = f"messages[{i}].tool_calls"
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise bad(f"{param} must be a list, in an assistant message", param)
    out["tool_calls"] = []
    for j, call in enumerate(calls):
        f = call.get("function") if isinstance(call, dict) else None
        args = f.get("arguments", "{}") if isinstance(f, dict) else None
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            args = None
        if not isinstance(f.get("name") if isinstance(f, dict) else None, str) or not isinstance(args, dict):
            raise bad(f"{param}[{j}] must be {{\"function\": {{\"name\", \"arguments\": a JSON object's text}}}}",
                      f"{param}[{j}]")
        out["tool_calls"].append({"id": call.get("id"), "type": "function",
                                  "function": {"name": f["name"], "arguments": args}})
    return out


def _chat_ids(body: dict, info: ModelInfo, tools: list | None) -> list[int]:
    msgs = _messages(body)
    tok = info.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad("this model has no chat template: use /v1/completions", "messages")
    _short_enough(sum(len(m["content"]) for m in msgs) + (len(json.dumps(tools)) if tools else 0), info, "messages")
    extra = {"tools": tools} if tools else {}
    try:
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **extra)
    except Exception as e:  # the template's own checks (e.g. roles must alternate): its words, nothing else's
        why = f": {show(str(e), 300)}" if _template_error(e) else ""
        raise bad(f"the chat template cannot render these messages{why}", "messages") from None
    ids = list(ids)
    if not ids:
        raise bad("messages render to no tokens", "messages")
    return _check_ids(ids, info, "messages")


def _template_error(e: Exception) -> bool:
    """An error the chat template raised itself (``raise_exception``, an undefined field): its text is for users."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # pragma: no cover - transformers renders templates with jinja2
        return False
    return isinstance(e, TemplateError)


def _stops(body: dict, info: ModelInfo) -> tuple[list[str], list[int]]:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    for s in stop:
        _unicode(s, "stop")
    if stop and info.tokenizer is None:
        raise bad("stop strings need a tokenizer, and this model has none: use stop_token_ids", "stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list):
        raise bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    for t in ids:
        if not _is_int(t) or not 0 <= t < info.vocab_size:
            raise bad(f"stop_token_ids holds {show(t)}, not a token id of the vocabulary (0..{info.vocab_size - 1})",
                      "stop_token_ids", "invalid_token_id")
    return list(dict.fromkeys(stop)), list(dict.fromkeys(int(t) for t in ids))


def _parse(body, info: ModelInfo, kind: str) -> GenRequest:
    """Every field checked, the numbers first: a request refused for a number is refused before it is tokenised."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _refuse_unsupported(body, kind)
    model = _model(body, info)
    names = ("max_tokens",) if kind == "completion" else ("max_completion_tokens", "max_tokens")
    max_tokens, param = None, names[-1]
    for name in names:
        v = _get_int(body, name)
        if v is not None:
            max_tokens, param = v, name
            break
    echo = kind == "completion" and _get_bool(body, "echo")
    try:
        prompt_logprobs = check_prompt_logprobs(_whole(body.get("prompt_logprobs")))
    except ParamError as e:
        raise bad(str(e), "prompt_logprobs") from None
    temperature = _get_real(body, "temperature")
    temperature = info.default_temperature if temperature is None else temperature
    top_p = _get_real(body, "top_p")
    top_p = 1.0 if top_p is None else top_p
    top_k = _get_int(body, "top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    seed = _get_int(body, "seed")
    if seed is not None and not -INT64 <= seed < INT64:
        raise bad(f"seed must be an integer in [-2**63, 2**63), got {show(seed)}", "seed")
    seed = None if seed is None else seed % INT64
    stop, stop_ids = _stops(body, info)
    stream = _get_bool(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("stream_options must be an object", "stream_options")
    ignore_eos, return_token_ids = _get_bool(body, "ignore_eos"), _get_bool(body, "return_token_ids")
    n, logprobs = _choices(body), _logprobs(body, kind)
    tokens_as_ids = _get_bool(body, "return_tokens_as_token_ids")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise bad(f"cache_salt must be a non-empty string, got {show(cache_salt)}", "cache_salt")
    # the ranges of SamplingParams and the engine (check_sampling); max_tokens is checked against the context below
    checked = _check_sampling({"max_tokens": param, "logprobs": "logprobs" if kind == "completion" else "top_logprobs"},
                              max_tokens=MAX_TOKENS if max_tokens is None else max(max_tokens, int(echo)),
                              temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop_ids, logprobs=logprobs,
                              vocab=info.vocab_size, **_processors(body))
    logprobs = checked["logprobs"]
    processors = {name: checked[name] for name in PROCESSORS}
    structured = _structured(body, info)
    tools, callable_, forced = _tools(body, info) if kind == "chat" else (None, [], {})
    if forced and structured:
        raise bad("a required or named tool_choice constrains the output: not with response_format or "
                  "structured_outputs", "tool_choice")
    if callable_ and stream:
        raise bad("tool calls are not streamed by this server: stream with tool_choice none, or without stream",
                  "stream", "unsupported_parameter")

    ids = _prompt_ids(body, info) if kind == "completion" else _chat_ids(body, info, tools)
    room = None if info.context is None else info.context - len(ids)
    if max_tokens is None:
        max_tokens = 16 if kind == "completion" else info.default_max_tokens
        if room is not None:
            max_tokens = min(max_tokens, room)
        if processors["min_tokens"] > max_tokens:
            raise bad(f"min_tokens {processors['min_tokens']} exceeds the {max_tokens} tokens this request may "
                      f"generate: give max_tokens", "min_tokens")
    elif room is not None and max_tokens > room:
        raise bad(f"{len(ids)} prompt tokens + {param} {max_tokens} = {len(ids) + max_tokens} exceeds the model's "
                  f"context of {info.context} positions", param, "context_length_exceeded")
    return GenRequest(
        kind=kind, model=model, prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=top_k, seed=seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos, stream=stream,
        include_usage=stream and _get_bool(opts, "include_usage"), return_token_ids=return_token_ids, n=n,
        logprobs=logprobs, tokens_as_ids=tokens_as_ids, cache_salt=cache_salt, processors=processors, echo=echo,
        prompt_text=_prompt_text(body) if echo else None, prompt_logprobs=prompt_logprobs,
        structured=structured or forced, tools=callable_,
    )


def _prompt_text(body: dict) -> str | None:
    """A completions prompt sent as text (alone or as a one-element list), else None."""
    p = body.get("prompt")
    p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str) else p
    return p if isinstance(p, str) else None


def _structured(body: dict, info: ModelInfo) -> dict:
    """The structured output asked for (OpenAI's ``response_format``, vLLM's ``structured_outputs``) as one
    ``SamplingParams`` field, checked (``check_structured``) and, with the served tokenizer, startable."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    fields, param, wire = {}, "response_format", {}
    if fmt not in (None, {}):
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            fields = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise bad("response_format json_schema needs json_schema.schema", "response_format")
            fields = {"json_schema": schema}
        elif kind != "text":
            raise bad(f"response_format type must be text, json_object or json_schema, got {show(kind)}",
                      "response_format", "unsupported_parameter")
    if extra is not None:
        names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                 "json_object": "json_object"}
        if not isinstance(extra, dict) or set(extra) - set(names):
            raise bad(f"structured_outputs must be an object with one of {', '.join(names)}", "structured_outputs")
        given = {names[k]: v for k, v in extra.items() if v is not None}
        if fields and given:
            raise bad("give response_format or structured_outputs, not both", "structured_outputs")
        fields, param = given, "structured_outputs"
        wire = {names[k]: f"structured_outputs.{k}" for k in extra}
    return _startable(fields, info, lambda name: wire.get(name, param))


def _startable(fields: dict, info: ModelInfo, param) -> dict:
    """``fields`` once ``check_structured`` accepts them and, with the served tokenizer, their grammar can begin; a
    400 naming ``param(field)`` otherwise."""
    try:
        grammar = check_structured(**fields)
        if grammar is not None and info.grammars is not None:
            info.grammars.matcher(grammar)
    except ParamError as e:
        raise bad(str(e), param(e.param)) from None
    return fields


TOOL_CHOICES = ("none", "auto", "required")


def _tools(body: dict, info: ModelInfo) -> tuple[list | None, list[dict], dict]:
    """A chat request's ``tools`` and ``tool_choice``: (the tools for the chat template, the functions an output may
    call, the structured-output field of a required or named call: ``{"name", "arguments"}`` with the function's name
    and its ``parameters`` schema, an anyOf over the functions for ``required``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None, [], {}
    if not isinstance(tools, list):
        raise bad("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    funcs = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if (not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]
                or not isinstance(f.get("parameters", {}), dict)):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\": a JSON "
                      f"schema}}}}", f"tools[{i}]")
        funcs.append(f)
    names = [f["name"] for f in funcs]
    if len(set(names)) < len(names):
        raise bad(f"tools holds a function name twice: {', '.join(names)}", "tools")
    if isinstance(choice, dict):
        f = choice.get("function") if choice.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if name not in names:
            raise bad(f"tool_choice names the function {show(name)}, which tools does not hold ({', '.join(names)})",
                      "tool_choice")
        funcs = [funcs[names.index(name)]]
    elif choice is None or choice in ("auto", "none"):
        return tools, [] if choice == "none" else funcs, {}
    elif choice != "required":
        raise bad(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": \"function\", \"function\": "
                  f"{{\"name\"}}}}, got {show(choice)}", "tool_choice")
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
    return tools, funcs, _startable({"json_schema": calls[0] if len(calls) == 1 else {"anyOf": calls}}, info,
                                    lambda name: "tools")


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def tool_calls(text: str, functions: list[dict]) -> list[dict] | None:
    """The calls ``text`` makes as OpenAI's ``message.tool_calls``, the arguments as JSON text: ``text`` is a JSON
    ``{"name", "arguments"}`` object (or a list of them), bare or each in ``<tool_call>`` tags, naming functions of
    ``functions``. None when it is anything else (plain content)."""
    parts = _TOOL_CALL.findall(text)
    if parts and _TOOL_CALL.sub("", text).strip():
        return None
    calls, names = [], {f["name"] for f in functions}
    for part in parts or [text]:
        try:
            value = json.loads(part)
        except ValueError:
            return None
        for call in value if isinstance(value, list) else [value]:
            args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
            if not isinstance(args, dict) or call.get("name") not in names:
                return None
            calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return calls or None


def _processors(body: dict) -> dict:
    """The logits processors' fields the request gave (OpenAI's penalties and ``logit_bias``, whose keys are token ids
    as strings; vLLM's ``min_p``, ``repetition_penalty``, ``min_tokens``), ready for ``check_sampling``."""
    values = {name: body[name] for name in PROCESSORS if name != "bad_words" and body.get(name) is not None}
    bias = values.get("logit_bias")
    if isinstance(bias, dict):
        try:
            values["logit_bias"] = {int(t) if isinstance(t, str) else t: b for t, b in bias.items()}
        except ValueError:
            raise bad(f"logit_bias keys must be token ids, got {show(bias)}", "logit_bias") from None
    if "min_tokens" in values:
        values["min_tokens"] = _whole(values["min_tokens"])
    return values


def _check_sampling(fields: dict, **values) -> dict:
    """``check_sampling(**values)``, its refusal as a 400 naming the field as the request gave it (``fields``: a
    ``SamplingParams`` field -> its name on the wire, where they differ)."""
    try:
        return check_sampling(**values)
    except ParamError as e:
        name = fields.get(e.param, e.param)
        raise bad(str(e).replace(e.param, name, 1), name) from None


def sampling_params(req: GenRequest, index: int = 0) -> SamplingParams:
    """The engine's settings for choice ``index`` of a validated request: its seed is ``seed + index`` (modulo
    2**63), so choice i of a request equals a request of one choice with that seed. ``max_tokens: 0`` (``echo``)
    generates one token, which the answer leaves out."""
    seed = None if req.seed is None else (req.seed + index) % INT64
    return SamplingParams(max_tokens=max(req.max_tokens, 1), prompt_logprobs=req.prompt_alternatives,
                          temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=seed,
                          stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=req.logprobs,
                          cache_salt=req.cache_salt, **req.processors, **req.structured)


def parse_completion(body, info: ModelInfo) -> GenRequest:
    """A ``/v1/completions`` body as a ``GenRequest``; raises ``APIError`` (400) on anything invalid."""
    return _parse(body, info, "completion")


def parse_chat(body, info: ModelInfo) -> GenRequest:
    """A ``/v1/chat/completions`` body as a ``GenRequest``; raises ``APIError`` (400) on anything invalid."""
    return _parse(body, info, "chat")


# ------------------------------------------------------------------------------------------------ log-probabilities


def token_id_text(token_id: int) -> str:
    """A token as ``return_tokens_as_token_ids`` renders it (vLLM's spelling), which a client maps back to the id."""
    return f"token_id:{token_id}"


class TokenTexts:
    """Each token id's own text (``decode([id])``, special tokens included: the strings log-probabilities are given
    under), decoded once and kept (at most one entry per token of the vocabulary). Without a tokenizer a token is
    ``"token_id:<id>"``."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def get(self, ids) -> list[str]:
        missing = [t for t in dict.fromkeys(ids) if t not in self.cache]
        if missing:
            texts = (self.tok.batch_decode([[t] for t in missing], skip_special_tokens=False)
                     if self.tok is not None else [token_id_text(t) for t in missing])
            self.cache.update(zip(missing, texts))
        return [self.cache[t] for t in ids]


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)  # -inf (probability 0) as OpenAI sends it


class Logprobs:
    """A request's ``TokenLogprob`` entries in the OpenAI shapes. Tokens are their own text (``TokenTexts``) or, with
    ``as_ids`` (``return_tokens_as_token_ids``), ``"token_id:<id>"``."""

    def __init__(self, texts: TokenTexts, as_ids: bool = False):
        self.texts, self.as_ids = texts, as_ids

    def _names(self, ids) -> list[str]:
        return [token_id_text(t) for t in ids] if self.as_ids else self.texts.get(ids)

    def completion(self, entries, output_ids: list[int]) -> dict:
        """The legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of ``entries``, the last
        ``len(entries)`` tokens of ``output_ids`` (the choice's tokens so far). ``top_logprobs[i]``: token -> logprob
        of the alternatives and of the chosen token (OpenAI: up to logprobs + 1 of them), most likely first;
        ``text_offset[i]``: where token i starts in the choice's text (the length of the text its earlier tokens
        decode to)."""
        names = self._names([e.token_id for e in entries])
        tops = []
        for e, name in zip(entries, names):
            pairs = [(lp, t) for t, lp in e.top]
            if all(t != e.token_id for t, _ in e.top):
                pairs.append((e.logprob, e.token_id))
            pairs.sort(key=lambda p: -p[0])  # stable: among equals the alternatives' order stays
            top: dict = {}
            for (lp, t), key in zip(pairs, self._names([t for _, t in pairs])):
                top.setdefault(key, _lp(lp))  # two ids of one spelling: the likelier keeps it
            tops.append(top)
        return {"tokens": names, "token_logprobs": [_lp(e.logprob) for e in entries], "top_logprobs": tops,
                "text_offset": self._offsets(output_ids, len(entries))}

    def _offsets(self, ids: list[int], n: int) -> list[int]:
        tok = self.texts.tok
        if tok is None or not n:
            return [0] * n
        start = len(ids) - n
        prefixes = [ids[:i] for i in range(start, len(ids))]
        return [len(t) for t in tok.batch_decode(prefixes, skip_special_tokens=True)]

    def chat(self, entries) -> dict:
        """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``: the
        chosen token and the alternatives asked for (``top_logprobs`` of them), most likely first; ``bytes`` are the
        UTF-8 bytes of ``token``."""
        content = []
        for e in entries:
            name, *alts = self._names([e.token_id] + [t for t, _ in e.top])
            content.append({"token": name, "logprob": _lp(e.logprob), "bytes": _bytes(name),
                            "top_logprobs": [{"token": a, "logprob": _lp(lp), "bytes": _bytes(a)}
                                             for a, (_, lp) in zip(alts, e.top)]})
        return {"content": content}

    def echoed(self, prompt_ids: list[int], entries, k: int, prompt_text: str, generated: dict | None) -> dict:
        """``completion``'s shape for an echoed prompt (``entries``: its prompt log-probabilities, None first; ``k``
        alternatives each) followed by ``generated`` (the output's, its offsets moved past ``prompt_text``): the first
        token's log-probability and alternatives are None, as OpenAI and vLLM send them."""
        body = self.completion([dataclasses.replace(e, top=e.top[:k]) for e in entries[1:]], prompt_ids)
        out = {"tokens": self._names(prompt_ids[:1]) + body["tokens"],
               "token_logprobs": [None] + body["token_logprobs"], "top_logprobs": [None] + body["top_logprobs"],
               "text_offset": [0] + body["text_offset"]}
        if generated:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                out[key] += generated[key]
            out["text_offset"] += [len(prompt_text) + o for o in generated["text_offset"]]
        return out

    def prompt(self, entries, k: int) -> list:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each ``{token id: {"logprob",
        "rank", "decoded_token"}}`` of the token itself and its ``k`` most likely alternatives (ranks 1..k)."""
        out: list = [None]
        for e in entries[1:]:
            alts = e.top[:k]
            names = self._names([e.token_id] + [t for t, _ in alts])
            item = {e.token_id: {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": names[0]}}
            for rank, ((t, lp), name) in enumerate(zip(alts, names[1:]), 1):
                item.setdefault(t, {"logprob": _lp(lp), "rank": rank, "decoded_token": name})
            out.append(item)
        return out

    def render(self, kind: str, entries, output_ids: list[int]) -> dict:
        return self.completion(entries, output_ids) if kind == "completion" else self.chat(entries)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


# ------------------------------------------------------------------------------------------------ responses


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class Choice:
    """One finished choice of a non-streamed answer: its text, token ids, finish reason and, when asked for, its
    ``logprobs`` field (``Logprobs.completion`` / ``Logprobs.chat``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: dict | None = None
    prompt_logprobs: list | None = None  # vLLM's (``Logprobs.prompt``), when asked for


def response(req: GenRequest, rid: str, created: int, choices: list[Choice]) -> dict:
    """The non-streamed response body: every choice, in index order; usage counts the prompt once and the completion
    tokens of every choice."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        choice: dict = {"index": c.index}
        if req.kind == "completion":
            choice.update(text=c.text, logprobs=c.logprobs, finish_reason=c.finish_reason)
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = c.prompt_logprobs
        else:
            calls = tool_calls(c.text, req.tools) if req.tools else None
            message = {"role": "assistant", "content": c.text} if calls is None else {
                "role": "assistant", "content": None, "tool_calls": calls}
            choice.update(message=message, logprobs=c.logprobs,
                          finish_reason=c.finish_reason if calls is None else "tool_calls")
        if req.return_token_ids:
            choice.update(prompt_token_ids=req.prompt_ids, token_ids=c.token_ids)
        out.append(choice)
    obj = "text_completion" if req.kind == "completion" else "chat.completion"
    body = {"id": rid, "object": obj, "created": created, "model": req.model, "system_fingerprint": None,
            "choices": out, "usage": usage(len(req.prompt_ids), sum(len(c.token_ids) for c in choices))}
    if req.kind == "chat" and req.prompt_logprobs is not None:  # vLLM: once, beside the choices
        body["prompt_logprobs"] = choices[0].prompt_logprobs if choices else None
    return body


def chunk(req: GenRequest, rid: str, created: int, text: str | None, token_ids: list[int] | None,
          finish_reason: str | None = None, first: bool = False, use: dict | None = None, index: int = 0,
          logprobs: dict | None = None) -> dict:
    """One stream chunk of choice ``index``, with the ``logprobs`` of its tokens when asked for. ``first``: the chat
    role delta (and, with ``return_token_ids``, the prompt's ids)."""
    choice: dict = {"index": index}
    if req.kind == "completion":
        obj = "text_completion"
        choice.update(text=text or "", logprobs=logprobs, finish_reason=finish_reason)
    else:
        obj = "chat.completion.chunk"
        delta: dict = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice.update(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
    if req.return_token_ids:
        if first:
            choice["prompt_token_ids"] = req.prompt_ids
        choice["token_ids"] = list(token_ids or [])
    body = {"id": rid, "object": obj, "created": created, "model": req.model, "system_fingerprint": None,
            "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(req: GenRequest, rid: str, created: int, use: dict) -> dict:
    """The extra last chunk of ``stream_options.include_usage``: no choices, the usage."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "system_fingerprint": None,
            "choices": [], "usage": use}


def now() -> int:
    return int(time.time())
