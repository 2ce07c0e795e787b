"""User-facing parameter and result types."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, fields

# Bounds on SamplingParams (``check_sampling``, which the engine and the server apply too). Each keeps a value inside
# what the engine's int64 tensors and float arithmetic hold, so a request that passes cannot fail the batch it joins.
INT64 = 2**63
MAX_TOKENS = 2**31 - 1  # no model's context comes near it; beyond, the per-row buffers could not be allocated
MAX_TOP_K = 2**31 - 1  # no vocabulary comes near it; a top_k above the vocabulary keeps every token (no filtering)
# At temperature 10^4 the warped distribution is within a few percent of uniform for any logits a model produces
# (spreads of a few hundred at most); larger values (Infinity, 1e308) only give noise, so they are taken for mistakes.
MAX_TEMPERATURE = 1e4
# Alternatives a request may ask for at each position (``SamplingParams.logprobs``): OpenAI's and vLLM's default bound.
# Each one is computed on the device and read back with the round, so the bound also bounds what a round reads.
MAX_LOGPROBS = 20
# Penalties and biases (``SamplingParams``): OpenAI's ranges for presence / frequency penalties and logit biases; a
# repetition penalty divides or multiplies logits, so it is a positive finite factor (1: off).
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_REPETITION_PENALTY = 1e4


class ParamError(ValueError):
    """A sampling parameter out of its range; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def show(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for error messages that echo a caller's value (a huge integer
    is shown by its size: Python refuses to print integers of more than 4300 digits)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) >= 10**40:
        return f"an integer of {int(value).bit_length()} bits"
    try:
        text = repr(value)
    except Exception:  # a repr that raises
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _integer(value):
    """``value`` as an ``int`` when it is an integer (numpy's included), else None; ``True``/``False`` are not."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None


def _real(value):
    """``value`` as a ``float`` when it is a real number (numpy's included), else None; ``True``/``False`` are not."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond float's range
        return math.inf


@dataclass
class SamplingParams:
    """Per-request generation settings.

    ``temperature`` 0 is greedy decoding (token-for-token equal to batch-size-1 greedy decoding). Above 0, tokens are
    sampled from the target's distribution warped by ``temperature``, then ``top_k`` (0: off), then ``top_p``
    (1.0: off); with a drafter, by speculative (rejection) sampling, which has exactly that distribution.
    ``seed`` (None: drawn from torch's global generator) makes a request reproducible whatever else is batched with it.
    ``logprobs`` (None: off) asks for log-probabilities: for every generated token, the target's log-softmax of its
    own logits (before temperature, top-k and top-p) at that token, and the ``logprobs`` most likely tokens there with
    theirs (``RequestOutput.logprobs``); with speculation the values are the verification forward's, the same as
    without.

    Every value is checked here (``check_sampling``), so a bad one fails at construction (``ParamError``, a ``ValueError`` naming the
    field), never in the middle of ``generate``: ``max_tokens`` in [1, 2**31); ``temperature`` finite in
    [0, ``MAX_TEMPERATURE``] (10^4: already near-uniform noise); ``top_k`` in [0, 2**31) (above the vocabulary it
    keeps every token); ``top_p`` in (0, 1]; ``seed`` in [0, 2**63); ``stop_token_ids`` in [0, 2**63);
    ``logprobs`` None or in [0, ``MAX_LOGPROBS``]. ``cache_salt`` (None: none): a prompt starts from cached blocks
    (``LLM(prefix_cache=)``) only of prompts with the same salt, so prompts of different salts never speed up or
    inform one another.

    ``prompt_logprobs`` (None: off; vLLM's): for every prompt token after the first, its log-probability under the
    target given the tokens before it, with its rank and the ``prompt_logprobs`` most likely tokens there
    (``RequestOutput.prompt_logprobs``, None for the first token); computed from the prefill's positions, which for
    such a prompt never start from cached blocks. Bounds: those of ``logprobs``.

    Logits processors, applied at every verified position to the logits batch-1 decoding would have there (drafts
    before a position count as emitted), so speculation keeps its exactness: ``logit_bias`` (token id -> bias added,
    in [-100, 100]); ``bad_words`` (token-id sequences never completed: their last token is masked after the rest);
    ``min_tokens`` (stop and EOS ids masked until that many tokens were generated, <= ``max_tokens``);
    ``repetition_penalty`` (> 0, 1: off; Hugging Face's: logits of tokens of prompt or output divided by it when
    positive, multiplied when negative); ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]; OpenAI's: minus
    the penalty once for a token of the output, minus it per occurrence); then temperature, top-k, top-p and
    ``min_p`` (in [0, 1]: tokens below ``min_p`` times the top probability dropped). ``stop`` strings end the
    output before their first match in its text (needs a tokenizer), as the server does.

    Structured output (at most one; needs a tokenizer and ``batchspec[grammar]``): ``json_schema`` (a JSON schema,
    dict or text), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (a
    Lark grammar, llguidance's dialect). JSON is laid out as ``json.dumps`` does (``JSON_LAYOUT``) unless the schema's
    ``"x-guidance"`` says otherwise. Tokens the grammar forbids are masked at every verified position, so greedy
    output equals batch-1 decoding with the same grammar; a request whose grammar reaches a dead end (no token the
    vocabulary can spell continues it) ends with finish reason "grammar".
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    cache_salt: str | None = None
    stop: list[str] = field(default_factory=list)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    bad_words: list[list[int]] = field(default_factory=list)
    prompt_logprobs: int | None = None
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self):
        checked = check_sampling(self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed,
                                 self.stop_token_ids, self.logprobs, **{n: getattr(self, n) for n in PROCESSORS})
        for name, value in checked.items():
            setattr(self, name, value)
        self.prompt_logprobs = check_prompt_logprobs(self.prompt_logprobs)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ParamError("cache_salt", f"cache_salt must be None or a string, got {show(self.cache_salt)}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", f"stop must be a string or a list of non-empty strings, got {show(self.stop)}")
        self.stop = list(stop)
        check_structured(**{name: getattr(self, name) for name in STRUCTURED})

    def structured(self) -> str | None:
        """The grammar the structured-output fields ask for, in llguidance's form (None: none)."""
        return check_structured(**{name: getattr(self, name) for name in STRUCTURED})


# The structured-output fields (``SamplingParams``), with the values that turn each off.
STRUCTURED = dict(json_schema=None, json_object=False, regex=None, choice=None, grammar=None)
# JSON output's layout where a schema does not set its own (llguidance's ``"x-guidance"`` key, e.g.
# ``{"whitespace_flexible": true}``): a space after each ":" and ",", no other whitespace (Python's ``json.dumps``).
# Free whitespace lets a model spend tokens on it, and it leaves a schema's keys and punctuation to the model's choice
# where a fixed layout forces them, so they are drafted at no cost (8 schemas' answers on the default model: 31% of
# the tokens forced, against 7% with free whitespace).
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def check_structured(json_schema=None, json_object=False, regex=None, choice=None, grammar=None) -> str | None:
    """The grammar text (llguidance's) that the one structured-output field given asks for, None when none is;
    ``ParamError`` naming the field when several are given or one is not valid (a schema or regex that does not
    compile, a grammar with errors)."""
    given = {name: v for name, v in dict(json_schema=json_schema, json_object=json_object, regex=regex,
                                         choice=choice, grammar=grammar).items() if v not in (None, False)}
    if not given:
        return None
    name, value = next(iter(given.items()))
    if len(given) > 1:
        raise ParamError(name, f"give at most one of {', '.join(STRUCTURED)}; got {', '.join(given)}")
    try:
        from llguidance import LLMatcher
    except ImportError:
        raise ParamError(name, f"{name} needs the grammar engine: pip install 'batchspec[grammar]'") from None
    if name == "json_object" and value is not True:
        raise ParamError(name, f"json_object must be a bool, got {show(value)}")
    if name in ("regex", "grammar") and not isinstance(value, str):
        raise ParamError(name, f"{name} must be a string, got {show(value)}")
    if name == "choice" and (not isinstance(value, (list, tuple)) or not value
                             or not all(isinstance(c, str) and c for c in value)):
        raise ParamError(name, f"choice must be a non-empty list of non-empty strings, got {show(value)}")
    if name == "json_schema" and not isinstance(value, (dict, str)):
        raise ParamError(name, f"json_schema must be a JSON schema (an object or its text), got {show(value)}")
    try:
        if name in ("json_schema", "json_object"):
            text = LLMatcher.grammar_from_json_schema({"type": "object"} if name == "json_object" else value,
                                                      defaults=JSON_LAYOUT)
        elif name == "regex":
            text = LLMatcher.grammar_from_regex(value)
        else:  # a choice is a grammar of its strings, each a Lark literal (JSON's escapes)
            text = LLMatcher.grammar_from_lark(value if name == "grammar" else
                                               "start: " + " | ".join(map(json.dumps, value)))
        error = LLMatcher.validate_grammar(text)
    except Exception as e:  # a schema the compiler refuses outright
        error = str(e)
    if error:
        raise ParamError(name, f"{name} is not valid: {error.strip()[:300]}")
    return text


# The logits processors' fields, with their values that turn each off (``SamplingParams``, the engine's ``Request``).
PROCESSORS = dict(min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
                  min_tokens=0, bad_words=None)


def check_sampling(max_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop_token_ids=(),
                   logprobs=None, *, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                   logit_bias=None, min_tokens=0, bad_words=None, vocab: int | None = None) -> dict:
    """The sampling values as plain Python numbers (numpy's become ``int`` / ``float``, the stop ids a list, the
    biases a dict of ``int`` -> ``float``, the bad words lists of ``int``), keyed by ``SamplingParams``' field names;
    ``ParamError`` naming the first one out of its range (the bounds are ``SamplingParams``'; token ids below
    ``vocab`` when given). The one set of rules ``SamplingParams``, the engine's ``check_request`` and the server's
    request validation apply."""
    max_tokens_, top_k_, temperature_, top_p_ = _integer(max_tokens), _integer(top_k), _real(temperature), _real(top_p)
    if max_tokens_ is None or not 1 <= max_tokens_ <= MAX_TOKENS:
        raise ParamError("max_tokens", f"max_tokens must be an integer >= 1 and < 2**31, got {show(max_tokens)}")
    if temperature_ is None or not 0 <= temperature_ <= MAX_TEMPERATURE:  # also refuses NaN and infinities
        raise ParamError("temperature", f"temperature must be >= 0 and <= {MAX_TEMPERATURE:g} (a finite number; 0 "
                                        f"is greedy), got {show(temperature)}")
    if top_k_ is None or not 0 <= top_k_ <= MAX_TOP_K:
        raise ParamError("top_k", f"top_k must be an integer >= 0 and < 2**31 (0 disables it), got {show(top_k)}")
    if top_p_ is None or not 0.0 < top_p_ <= 1.0:
        raise ParamError("top_p", f"top_p must be in (0, 1] (1 disables it), got {show(top_p)}")
    seed_ = None if seed is None else _integer(seed)
    if seed is not None and (seed_ is None or not 0 <= seed_ < INT64):
        raise ParamError("seed", f"seed must be an integer in [0, 2**63), got {show(seed)}")
    stops = None if isinstance(stop_token_ids, (str, bytes)) else _token_ids(stop_token_ids)
    if stops is None:
        raise ParamError("stop_token_ids", "stop_token_ids must be a list of integer token ids >= 0 and < 2**63, "
                                           f"got {show(stop_token_ids)}")
    logprobs_ = None if logprobs is None else _integer(logprobs)
    if logprobs is not None and (logprobs_ is None or not 0 <= logprobs_ <= MAX_LOGPROBS):
        raise ParamError("logprobs", f"logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}] (the "
                                     f"alternatives returned at each position), got {show(logprobs)}")
    return dict(max_tokens=max_tokens_, temperature=temperature_, top_k=top_k_, top_p=top_p_, seed=seed_,
                stop_token_ids=stops, logprobs=logprobs_,
                **_check_processors(max_tokens_, min_p, repetition_penalty, presence_penalty, frequency_penalty,
                                    logit_bias, min_tokens, bad_words, INT64 if vocab is None else vocab))


def check_prompt_logprobs(value) -> int | None:
    """``prompt_logprobs`` as an ``int`` (None: off), or ``ParamError``: the bounds of ``logprobs``."""
    n = None if value is None else _integer(value)
    if value is not None and (n is None or not 0 <= n <= MAX_LOGPROBS):
        raise ParamError("prompt_logprobs", f"prompt_logprobs must be None (off) or an integer in [0, {MAX_LOGPROBS}] "
                                            f"(the alternatives returned at each prompt position), got {show(value)}")
    return n


def _check_processors(max_tokens, min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias,
                      min_tokens, bad_words, vocab) -> dict:
    """``check_sampling``'s part for the logits processors."""
    min_p_, rep, min_tokens_ = _real(min_p), _real(repetition_penalty), _integer(min_tokens)
    if min_p_ is None or not 0.0 <= min_p_ <= 1.0:
        raise ParamError("min_p", f"min_p must be in [0, 1] (0 disables it), got {show(min_p)}")
    if rep is None or not 0.0 < rep <= MAX_REPETITION_PENALTY:
        raise ParamError("repetition_penalty", f"repetition_penalty must be > 0 and <= {MAX_REPETITION_PENALTY:g} "
                                               f"(1 disables it), got {show(repetition_penalty)}")
    penalties = {}
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        penalties[name] = _real(value)
        if penalties[name] is None or not -MAX_PENALTY <= penalties[name] <= MAX_PENALTY:
            raise ParamError(name, f"{name} must be in [-2, 2] (0 disables it), got {show(value)}")
    if min_tokens_ is None or not 0 <= min_tokens_ <= max_tokens:
        raise ParamError("min_tokens", f"min_tokens must be an integer >= 0 and <= max_tokens, got {show(min_tokens)}")
    bias = {} if logit_bias is None else None
    if isinstance(logit_bias, dict):
        bias = {_integer(t): _real(b) for t, b in logit_bias.items()}
        if any(t is None or not 0 <= t < vocab or b is None or not -MAX_BIAS <= b <= MAX_BIAS for t, b in bias.items()):
            bias = None
    if bias is None:
        raise ParamError("logit_bias", f"logit_bias must map token ids in [0, {vocab}) to biases in [-100, 100], got "
                                       f"{show(logit_bias)}")
    words = [] if bad_words is None else None
    if isinstance(bad_words, (list, tuple)):
        words = [None if isinstance(w, (str, bytes)) else _token_ids(w) for w in bad_words]
        if any(not w or max(w) >= vocab for w in words):
            words = None
    if words is None:
        raise ParamError("bad_words", f"bad_words must be a list of non-empty lists of token ids in [0, {vocab}), "
                                      f"got {show(bad_words)}")
    return dict(min_p=min_p_, repetition_penalty=rep, logit_bias=bias, min_tokens=min_tokens_, bad_words=words,
                **penalties)


def _token_ids(values) -> list[int] | None:
    """``values`` as a list of ints in [0, 2**63), or None when it is not an iterable of such integers."""
    try:
        ids = [_integer(v) for v in values]
    except TypeError:
        return None
    return None if any(i is None or not 0 <= i < INT64 for i in ids) else ids


@dataclass
class TokenLogprob:
    """One generated token's log-probability under the target (log-softmax of its raw logits at that position), and
    the most likely tokens there, most likely first, as ``(token_id, logprob)`` (as many as the request asked for).
    ``rank``: 1 + the tokens more likely than it (given for prompt tokens; None for generated ones)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length"
    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids`` when asked for (``SamplingParams``)
    # one per prompt token when asked for (``SamplingParams.prompt_logprobs``): None for the first, as vLLM
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


@dataclass
class Stats:
    """Counters and per-stage seconds since the last reset."""

    rounds: int = 0  # engine rounds (one per batch step)
    verify_calls: int = 0  # target forwards after prefill
    drafted: int = 0
    accepted: int = 0
    row_rounds: int = 0  # sum over rounds of rows in the batch
    generated: int = 0  # tokens emitted
    ragged_rounds: int = 0  # rounds in which rows of the batch accepted different numbers of draft tokens
    joined_running: int = 0  # requests spliced into a batch that was already running (continuous batching)
    prefix_hits: int = 0  # prompts whose prefill started from cached blocks (``Runner.prefixes``)
    prefix_tokens: int = 0  # their prompt tokens taken from the cache, not computed
    prefix_evictions: int = 0  # cached blocks dropped for room
    prefill_chunks: int = 0  # chunks of long prompts prefilled into the kept prefixes before they joined
    kept_first: int = 0  # waiting requests whose prompts were kept moved ahead of ones that cost a prefill
    dropped_after_stop: int = 0  # verified tokens discarded because a stop token came earlier in the same round
    full_accepts: int = 0  # row-rounds that accepted every proposed draft token (the bonus came after the last one)
    grouped_rounds: int = 0  # exspec: rounds whose batch had rows of one length (no realignment needed)
    fallback_rounds: int = 0  # exspec: rounds whose batch mixed lengths (the layout realigned it)
    # structured output: rounds that drafted tokens a grammar forced (the one token its mask allows), those tokens
    # (part of ``drafted``) and those accepted (part of ``accepted``)
    forced_rounds: int = 0
    forced_drafted: int = 0
    forced_accepted: int = 0
    lengths: dict = field(default_factory=dict)  # drafts of the row that drafted most -> rounds
    decisions: dict = field(default_factory=dict)  # what decided a round's budget -> rounds (``speculation.REASONS``)
    kinds: dict = field(default_factory=dict)  # kind of drafting round (the head's "copy", "head") -> rounds
    # KV memory of the running rows after the last step (``engine.memory``): bytes the rectangle's slots take, the
    # most they took, bytes the cache buffers hold, bytes the rows' cached tokens need, and the budget (0: none)
    kv_bytes_used: int = 0
    kv_bytes_peak: int = 0
    kv_bytes_held: int = 0
    kv_bytes_visible: int = 0
    kv_bytes_budget: int = 0
    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    align: float = 0.0
    schedule: float = 0.0  # moving rows between a scheduler's window and the round's batch
    total: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per row per round, bonus token included (1.0 for plain decoding)."""
        return (self.accepted + self.row_rounds) / self.row_rounds if self.row_rounds else 0.0

    @property
    def rounds_without_drafting(self) -> int:
        """Rounds that verified no draft (plain decoding steps)."""
        return self.lengths.get(0, 0)

    @property
    def grouping_rate(self) -> float | None:
        """Share of rounds whose batch had rows of identical length (exspec; None for other schedulers)."""
        n = self.grouped_rounds + self.fallback_rounds
        return self.grouped_rounds / n if n else None

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.total if self.total else 0.0

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(mean_accepted_length=self.mean_accepted_length, tokens_per_second=self.tokens_per_second,
                 grouping_rate=self.grouping_rate, rounds_without_drafting=self.rounds_without_drafting)
        return d
