"""Token-level output metrics against the batch-size-1 oracle.

Every metric works on token ids after ``truncate``: an output ends at its first stop token (kept) or at
``max_tokens``, whichever comes first, so text decoding and whitespace never enter a comparison.

Repetition rule: an output *ends in a loop* when, for some period ``p`` in ``1..max_period`` (default 16), its tail is
``p``-periodic (every token equals the one ``p`` before it) over a span of at least ``max(min_repeats * p, min_span)``
tokens (defaults 3 and 8): eight identical tokens, four repeats of a 2-gram, three repeats of a 3..16-gram. A trailing
stop token is ignored. The repetition rate of a set of outputs is the fraction that end in a loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def truncate(ids: Sequence[int], stop_ids: Iterable[int] = (), max_tokens: int | None = None) -> list[int]:
    """``ids`` cut after the first stop token (inclusive) and at ``max_tokens``."""
    out = [int(t) for t in ids]
    if max_tokens is not None:
        out = out[:max_tokens]
    stops = set(int(s) for s in stop_ids)
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def first_divergence(output: Sequence[int], oracle: Sequence[int]) -> int | None:
    """Index of the first token where ``output`` and ``oracle`` differ (a length difference counts), or None."""
    if list(output) == list(oracle):
        return None
    return common_prefix(output, oracle)


def exact_match(output: Sequence[int], oracle: Sequence[int]) -> bool:
    return list(output) == list(oracle)


def partial_match(output: Sequence[int], oracle: Sequence[int]) -> float:
    """Common-prefix length over the oracle's length (over the output's, in the odd case that it runs past the
    oracle); 1.0 exactly when the two are equal."""
    if list(output) == list(oracle):
        return 1.0
    return common_prefix(output, oracle) / max(len(oracle), len(output))


def rouge_l(output: Sequence[int], oracle: Sequence[int]) -> float:
    """ROUGE-L F-measure (``rouge-score``) of the two id sequences written as space-separated numbers.

    Reported to show how an overlap metric masks corruption: a row that loops on the right tokens still scores high.
    """
    if not output and not oracle:
        return 1.0
    return _scorer().score(" ".join(map(str, oracle)), " ".join(map(str, output)))["rougeL"].fmeasure


_SCORER = None


def _scorer():
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return _SCORER


def loop_period(
    ids: Sequence[int], stop_ids: Iterable[int] = (), max_period: int = 16, min_repeats: int = 3, min_span: int = 8
) -> int | None:
    """The smallest period ``p`` whose repetition covers the tail of ``ids`` (see the module rule), or None."""
    seq = list(ids)
    if seq and seq[-1] in set(stop_ids):
        seq = seq[:-1]
    n = len(seq)
    for p in range(1, max_period + 1):
        need = max(min_repeats * p, min_span)
        if need > n:
            break
        span = p
        i = n - 1
        while i - p >= 0 and seq[i] == seq[i - p]:
            span += 1
            i -= 1
        if span >= need:
            return p
    return None


def ends_in_loop(ids: Sequence[int], stop_ids: Iterable[int] = (), **rule) -> bool:
    return loop_period(ids, stop_ids, **rule) is not None


def repetition_rate(outputs: Sequence[Sequence[int]], stop_ids: Iterable[int] = (), **rule) -> float:
    stop_ids = set(stop_ids)
    return sum(ends_in_loop(o, stop_ids, **rule) for o in outputs) / len(outputs) if outputs else 0.0
