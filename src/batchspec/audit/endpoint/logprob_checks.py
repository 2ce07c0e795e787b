"""Checks of the log-probabilities a server returns, each fault a one-line reason: every token has one, it is <= 0
and agrees with its ``top_logprobs``; greedy, the returned token is the most likely listed (or a recorded near-tie);
values that are all the same (a server that fills in 0.0) are named; the values at concurrency N equal those at the
lowest level within ``CONCURRENCY_TOLERANCE``."""

from __future__ import annotations

import math

from .answer import _token_id

SLACK = 1e-4  # nats: how far above 0, or apart from its top_logprobs entry, a token's log-probability may be (rounding)
CONCURRENCY_TOLERANCE = 1e-3  # nats: the largest difference allowed between a token's values at two levels


def _num(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _top(pairs) -> dict[int, float]:
    out = {}
    for token, value in pairs:
        t, v = _token_id(token), _num(value)
        if t is not None and v is not None:
            out[t] = v
    return out


def _parse(ids: list, raw) -> list | None:
    """One chunk's ``[token id, log-probability or None, {id: log-probability}]`` per token, None when its form has
    not one entry per token."""
    if not isinstance(raw, dict):
        return None
    if isinstance(raw.get("content"), list):
        items = [i if isinstance(i, dict) else {} for i in raw["content"]]
        got = [(i.get("logprob"), _top((a.get("token"), a.get("logprob")) for a in i.get("top_logprobs") or []
                                       if isinstance(a, dict))) for i in items]
    elif isinstance(raw.get("tokens"), list):
        lps, tops = raw.get("token_logprobs") or [], raw.get("top_logprobs") or []
        got = [(lps[k] if k < len(lps) else None,
                _top(tops[k].items()) if k < len(tops) and isinstance(tops[k], dict) else {})
               for k in range(len(raw["tokens"]))]
    else:
        return None
    if len(got) != len(ids):
        return None
    return [[t, _num(v), top] for t, (v, top) in zip(ids, got)]


def positions(raw_logprobs, token_ids) -> list | None:
    """``[token id, log-probability or None, {id: log-probability}]`` per returned token from an answer's
    ``raw_logprobs``; a chunk whose form cannot be matched to its tokens gives None values (missing). None when
    log-probabilities were not asked for."""
    if raw_logprobs is None or not isinstance(token_ids, list):
        return None
    out = []
    for ids, raw in raw_logprobs:
        if isinstance(ids, list) and ids:
            out += _parse(ids, raw) or [[t, None, {}] for t in ids]
    return out


def answer_faults(pos: list, rel_tol: float) -> tuple[list[str], list[int]]:
    """The faults of one answer's ``positions`` (each a line) and the indices of its recorded near-ties: positions
    where another listed token is within ``rel_tol`` times max(1, largest |value| listed) of the returned one (above
    it by more is a fault at temperature 0)."""
    faults, ties = [], []
    missing = [k for k, (_, v, _) in enumerate(pos) if v is None]
    if missing:
        faults.append(f"log-probabilities missing for {len(missing)} of {len(pos)} tokens (first: token {missing[0]})")
    values = [x for t, v, top in pos for x in ({t: v, **top} if v is not None else top).values()]
    if len(values) > 1 and len(set(values)) == 1:
        faults.append(f"constant log-probabilities (all {values[0]:g})")
        return faults, ties
    for k, (t, v, top) in enumerate(pos):
        if v is None:
            continue
        if v > SLACK:
            faults.append(f"token {k} ({t}) has log-probability {v:.6g} > 0")
        elif t in top and abs(top[t] - v) > SLACK:
            faults.append(f"token {k} ({t}) has log-probability {v:.6g} but {top[t]:.6g} in its top_logprobs")
        elif t not in top and top and v > min(top.values()) + SLACK:
            faults.append(f"token {k} ({t}) has log-probability {v:.6g}, above its top_logprobs, which leave it out")
        elif len(top.keys() - {t}):
            best, lp = max(((a, x) for a, x in top.items() if a != t), key=lambda kv: kv[1])
            tol = rel_tol * max(1.0, max(abs(x) for x in top.values()))
            if lp - v > tol:
                faults.append(f"token {k} is {t} (log-probability {v:.6g}) but {best} is more likely ({lp:.6g}) at "
                              "temperature 0")
            elif lp - v >= -tol:
                ties.append(k)
        if len(faults) >= 3:
            break
    return faults, ties


def level_drift(pos: list, base: list, tolerance: float = CONCURRENCY_TOLERANCE) -> str | None:
    """How the values of one prompt's answer (``pos``) differ from those at the lowest level (``base``) on the tokens
    they share, beyond ``tolerance``; None when they agree."""
    worst = (0.0, None, None)
    for k, ((t, v, top), (bt, bv, btop)) in enumerate(zip(pos, base)):
        if t != bt:
            break
        pairs = [(v, bv)] + [(top[a], btop[a]) for a in top.keys() & btop.keys()]
        for x, y in pairs:
            if x is not None and y is not None and abs(x - y) > worst[0]:
                worst = (abs(x - y), k, t)
    if worst[0] <= tolerance:
        return None
    return f"log-probabilities differ by {worst[0]:.3g} at token {worst[1]} ({worst[2]}) from the lowest level's " \
           f"(tolerance {tolerance:g})"
