"""One answer of the endpoint audit (``Answer``) and the checks that need nothing but its fields: token ids that are
token ids, a finish_reason that agrees with the tokens, log-probabilities read back as token ids."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TOKEN_IDS = "token_ids"
RETOKENIZED = "retokenized text"

PROMPT_MISMATCH = "prompt mismatch"
PROTOCOL_ERROR = "protocol error"

_TOKEN_ID = re.compile(r"token_id:(\d{1,18})")  # a longer number is no token id (and too long to parse cheaply)


@dataclass
class Answer:
    """One request's outcome. ``ids``: the generated token ids as returned, whole; ``source``: how they were read
    (None: there is nothing to compare). What is wrong beyond the tokens, each a one-line reason: ``error`` (the
    request failed), ``protocol_error`` (the answer's ids are not token ids), ``finish_problem`` (its finish_reason
    disagrees with its tokens), ``prompt_mismatch`` (its prompt_token_ids are not the ids sent). ``logprobs``: per
    generated token, ``{token id: log-probability}`` of the tokens the answer listed there (None: none, or not one
    per token); ``raw_logprobs``: when they were asked for, each ``(token ids, logprobs field)`` as the server sent
    them (one pair, or one per stream chunk), for the log-probability checks."""

    ids: list[int]
    source: str | None
    prompt_ids: list[int] | None = None
    error: str | None = None
    finish_reason: str | None = None
    protocol_error: str | None = None
    finish_problem: str | None = None
    prompt_mismatch: str | None = None
    logprobs: list[dict[int, float]] | None = None
    raw_logprobs: list | None = None

    def problems(self) -> list[tuple[str, str]]:
        """(kind, reason) of each thing wrong with the answer beyond its tokens."""
        kinds = (("failed", self.error), (PROTOCOL_ERROR, self.protocol_error), ("finish_reason", self.finish_problem),
                 (PROMPT_MISMATCH, self.prompt_mismatch))
        return [(kind, why) for kind, why in kinds if why]


def short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bad_ids(value, vocab: int | None, what: str) -> str | None:
    """Why ``value`` is not a list of token ids of a ``vocab``-token vocabulary (None: it is one)."""
    if not isinstance(value, list):
        return f"{what} is {short(value)}, not a list of token ids"
    for k, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            return f"{what}[{k}] is {short(t)}, not a token id (an integer {f'in 0..{vocab - 1}' if vocab else '>= 0'})"
    return None


def first_difference(mine: list, theirs: list) -> int:
    """The first index at which two id lists differ (a length difference counts)."""
    return next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))


def finish_problem(ids: list[int] | None, reason, stops: list[int], max_tokens: int) -> str | None:
    """How ``reason`` disagrees with the output ``ids`` (None: it agrees; ids None: only the value is checked)."""
    if reason not in ("stop", "length"):
        return "no finish_reason" if reason is None else f"finish_reason {short(reason)}: not 'stop' or 'length'"
    if ids is None:
        return None
    if reason == "stop" and not (ids and ids[-1] in stops):
        end = f"ends with {ids[-1]}" if ids else "is empty"
        return f"finish_reason 'stop' but the output {end}, not a stop token {stops}"
    if reason == "length" and len(ids) < max_tokens:
        return f"finish_reason 'length' after {len(ids)} tokens, fewer than max_tokens {max_tokens}"
    return None


def _token_id(token) -> int | None:
    """The id of a logprobs token written as ``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids``), else None."""
    m = _TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
    return int(m.group(1)) if m else None


def _put(entry: dict, token, logprob) -> None:
    """Put a listed number in ``entry`` as it is, even one that is no log-probability (positive, infinite, NaN): the
    logprob rule then refuses the whole entry rather than weigh what is left of it."""
    t = _token_id(token)
    if t is not None and isinstance(logprob, (int, float)) and not isinstance(logprob, bool):
        try:
            entry[t] = float(logprob)
        except OverflowError:  # an integer beyond any float
            entry[t] = math.inf if logprob > 0 else -math.inf


def logprob_entries(raw) -> list[dict[int, float]] | None:
    """One answer's (or stream chunk's) ``logprobs`` as one ``{token id: log-probability}`` per generated token: the
    completions form (``tokens``, ``token_logprobs``, ``top_logprobs``) or the chat form (``content``: ``token``,
    ``logprob``, ``top_logprobs``). Tokens not written as ``"token_id:N"`` and values that are not numbers are left
    out (numbers that are no log-probabilities are kept, for ``usable_entry`` to refuse); None when ``raw`` is
    neither form."""
    if not isinstance(raw, dict):
        return None
    if "content" in raw:
        return _chat_entries(raw["content"])
    tokens, lps, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not isinstance(tokens, list):
        return None
    out = []
    for k, token in enumerate(tokens):
        entry = {}
        if isinstance(tops, list) and k < len(tops) and isinstance(tops[k], dict):
            for key, v in tops[k].items():
                _put(entry, key, v)
        if isinstance(lps, list) and k < len(lps):
            _put(entry, token, lps[k])
        out.append(entry)
    return out


def _chat_entries(content) -> list[dict[int, float]] | None:
    """``logprob_entries`` of the chat form's ``content``."""
    if not isinstance(content, list):
        return None
    out = []
    for item in content:
        entry: dict[int, float] = {}
        if isinstance(item, dict):
            for alt in item.get("top_logprobs") or []:
                if isinstance(alt, dict):
                    _put(entry, alt.get("token"), alt.get("logprob"))
            _put(entry, item.get("token"), item.get("logprob"))
        out.append(entry)
    return out


def usable_entry(entry: dict[int, float]) -> bool:
    """Whether every number listed is a log-probability: in (-inf, 0], finite."""
    return all(-math.inf < v <= 0 for v in entry.values())


def aligned(entries, token_ids):
    """``entries`` when there is one per token id, else None (logprobs that cannot be matched to the tokens)."""
    if isinstance(token_ids, list) and not token_ids:
        return []  # a chunk without tokens (the first, with the prompt's ids; the last, with finish_reason)
    if entries is None or not isinstance(token_ids, list) or len(entries) != len(token_ids):
        return None
    return entries


def streamed_logprobs(answer) -> list[dict[int, float]] | None:
    """The log-probabilities of a ``StreamedAnswer``'s tokens: each chunk's belong to its tokens (None as soon as one
    chunk's cannot be matched to them)."""
    out: list = []
    for ids, raw in zip(answer.token_chunks, answer.logprob_chunks):
        got = aligned(logprob_entries(raw), ids)
        if got is None:
            return None
        out += got
    return out
