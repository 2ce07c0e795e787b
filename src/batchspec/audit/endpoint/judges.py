"""How the endpoint audit compares one level's answers with the reference's and classes their divergences: the judges
(the local oracle's margin rule, ``OracleJudge``; a reference server's log-probabilities, ``ReferenceJudge`` and
``logprob_divergence``), the black-box records of the padding rule (``black_box_records``), and the level's row and
signature (``compare_level``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..attribution import OVERRUN, REFERENCE, Divergence
from .answer import PROMPT_MISMATCH, PROTOCOL_ERROR, TOKEN_IDS, Answer, first_difference, short, usable_entry
from .client import ConcurrentRun

COULD_NOT_AUDIT = "could not audit"
INCOMPLETE = "incomplete"
UNATTRIBUTED = "unattributed"  # a divergence class and a signature: no log-probabilities to tell what it is
# the signatures of a level beyond the audit's own (``batchspec.audit.attribution.SIGNATURES``)
ENDPOINT_SIGNATURES = (COULD_NOT_AUDIT, PROMPT_MISMATCH, OVERRUN, PROTOCOL_ERROR, INCOMPLETE, UNATTRIBUTED)
# The largest |log-probability| that the logprob rule's tolerance scales with. The listed values stand in for the
# logits' scale, but a listed -9999 (or any far tail) says nothing about the rounding between the top tokens, and
# must not widen the tolerance until every divergence looks like a near tie; real logit scales are tens at most.
MAX_LOGIT_SCALE = 30.0


@dataclass
class LogprobDivergence(Divergence):
    """A divergence attributed from the reference's log-probabilities; ``basis`` says how: ``"logprobs"`` (both
    tokens listed), ``"bound"`` (the endpoint's token is not listed: the margin is a lower bound) or None
    (unattributed, or a length difference)."""

    basis: str | None = None

    def as_dict(self) -> dict:
        return {**super().as_dict(), "basis": self.basis}


def logprob_divergence(i: int, output, ref, entry: dict[int, float] | None, index: int,
                       rel_tol: float) -> Divergence:
    """Attribute prompt ``i``'s first divergence at ``index`` from ``entry``, the reference answer's
    ``{token id: log-probability}`` at that position (None: it has none); see the package's logprob rule."""
    from .. import attribution as attr

    o_tok = ref[index] if index < len(ref) else None
    e_tok = output[index] if index < len(output) else None
    if o_tok is None or e_tok is None:  # a length difference: no token to weigh, as with the margin rule
        return LogprobDivergence(i, index, None, None, "synchronization", o_tok, e_tok)
    if not entry or o_tok not in entry or not usable_entry(entry):
        return LogprobDivergence(i, index, None, None, UNATTRIBUTED, o_tok, e_tok)
    tol = rel_tol * min(max(1.0, max(abs(v) for v in entry.values())), MAX_LOGIT_SCALE)
    if e_tok in entry:
        margin = entry[o_tok] - entry[e_tok]
        return LogprobDivergence(i, index, margin, tol, attr.classify(margin, tol), o_tok, e_tok, "logprobs")
    bound = entry[o_tok] - min(entry.values())  # the endpoint's token is below every listed one
    if bound > tol:
        return LogprobDivergence(i, index, bound, tol, "synchronization", o_tok, e_tok, "bound")
    return LogprobDivergence(i, index, None, tol, UNATTRIBUTED, o_tok, e_tok)


class OracleJudge:
    """The local oracle: its outputs, the margin rule, the audit's black-box records."""

    def __init__(self, ids, ref, stops, ctx, probe, rel_tol):
        self.ids, self.refs, self.stops, self.ctx, self.probe, self.rel_tol = ids, ref, stops, ctx, probe, rel_tol
        self.max_tokens = ctx.max_tokens

    def divergence(self, i, cut, j):
        return self.probe.divergence(i, self.ids[i], cut, self.refs[i], j, self.rel_tol)

    def prompt_mismatch(self, i, answer):
        return None

    def records(self, run, cuts, flagged):
        return black_box_records(run, cuts, self.refs, [len(p) for p in self.ids], flagged, self.stops, self._solo)

    def _solo(self, run, i) -> bool:
        from .. import metrics

        solo = metrics.truncate(run.call([self.ids[i]])[0], self.stops, self.max_tokens)
        j = metrics.first_divergence(solo, self.refs[i])
        return j is None or self.divergence(i, solo, j).cls == "numerical"


class ReferenceJudge:
    """A reference server's answers at concurrency 1: the outputs (None for a prompt whose answer cannot serve), its
    log-probabilities for the logprob rule, its prompt ids, and the black-box records from re-runs at the endpoint."""

    def __init__(self, items, answers: list[Answer], ref_client, stops, max_tokens, rel_tol, client):
        self.items, self.answers, self.stops, self.max_tokens = items, answers, stops, max_tokens
        self.rel_tol, self.client = rel_tol, client
        self.refused = ref_client.logprobs_refused
        self.refs, self.problems = [], []
        for i, a in enumerate(answers):
            if a.source == TOKEN_IDS:  # the stop tokens are known now: check its finish_reason again
                a.finish_problem = ref_client._finish_problem(a.ids, a.finish_reason)
            self._add(i, a)

    def _add(self, i: int, a: Answer) -> None:
        """Prompt ``i``'s reference output, or None with the problems that leave it out."""
        from .. import metrics

        problems = a.problems()
        cut = metrics.truncate(a.ids, self.stops, self.max_tokens) if a.source is not None else None
        if cut is not None and len(a.ids) > len(cut):
            problems.append((OVERRUN, f"{len(a.ids) - len(cut)} tokens after index {len(cut) - 1}"))
        self.problems += [{"prompt": i, "kind": kind, "detail": why} for kind, why in problems]
        self.refs.append(cut if a.source is not None and not problems else None)

    def logprobs_status(self, asked: int) -> str:
        if not asked:
            return "not asked for"
        if self.refused:
            return f"refused: {self.refused}"
        usable = [i for i, r in enumerate(self.refs) if r is not None]
        have = sum(self.answers[i].logprobs is not None for i in usable)
        if not have:
            return "not returned (as token ids)"
        return "returned" if have == len(usable) else f"returned for {have} of {len(usable)} answers"

    def divergence(self, i, cut, j):
        lps = self.answers[i].logprobs
        entry = lps[j] if lps is not None and j < len(lps) else None
        return logprob_divergence(i, cut, self.refs[i], entry, j, self.rel_tol)

    def prompt_mismatch(self, i, answer):
        """Prompts sent as text: the endpoint's prompt ids must be the reference's."""
        mine, theirs = answer.prompt_ids, self.answers[i].prompt_ids
        if not isinstance(self.items[i], str) or mine is None or theirs is None or mine == theirs:
            return None
        k = first_difference(mine, theirs)
        return (f"the server's prompt_token_ids ({len(mine)} ids) differ from the reference's ({len(theirs)} ids) at "
                f"index {k}: {short(mine[k:k + 8])} where the reference has {short(theirs[k:k + 8])}")

    def _length(self, i):
        item = self.items[i]
        if not isinstance(item, str):
            return len(item)
        ids = self.answers[i].prompt_ids
        return len(ids) if ids is not None else None

    def records(self, run, cuts, flagged):
        return black_box_records(run, cuts, self.refs, [self._length(i) for i in range(len(self.items))], flagged,
                                 self.stops, self._solo)

    def _solo(self, run, i) -> bool:
        from .. import metrics

        solo = self.client.one(self.items[i])
        cut = metrics.truncate(solo.ids, self.stops, self.max_tokens)
        j = metrics.first_divergence(cut, self.refs[i])
        return solo.source is not None and (j is None or self.divergence(i, cut, j).cls == "numerical")


def black_box_records(run: ConcurrentRun, cuts, refs, lengths, flagged, stops, solo_clean) -> list[dict]:
    """The records of ``attribution.black_box_signature`` for the ``flagged`` divergences of one level. A server
    batches the requests it has under way, whenever they came and in an order of its own, so a prompt counts as
    *padded* when a request under way at the same time (``run.spans``) was or grew longer than it (its prompt plus its
    output longer than this prompt; ``lengths``: prompt lengths, None where unknown), not by its place in a fixed
    batch; ``solo_clean(run, i)``: whether prompt ``i`` decodes cleanly alone, asked only when the padding rule could
    apply."""
    from .. import metrics

    def padded(i) -> bool:
        n, (start, end) = lengths[i], run.spans[i]
        return n is not None and any(
            j != i and lengths[j] is not None and lengths[j] + len(cuts[j]) > n and s < end and start < e
            for j, (s, e) in enumerate(run.spans))

    recs = [{"prompt": d.prompt, "partial_match": metrics.partial_match(cuts[d.prompt], refs[d.prompt]),
             "padded": padded(d.prompt), "loops": metrics.ends_in_loop(cuts[d.prompt], stops),
             "oracle_loops": metrics.ends_in_loop(refs[d.prompt], stops), "solo_clean": None} for d in flagged]
    if run.concurrency > 1 and recs and all(r["padded"] for r in recs):
        for r in recs:
            r["solo_clean"] = solo_clean(run, r["prompt"])
    return recs


def compare_level(name, run: ConcurrentRun, answers: list[Answer], judge):
    """The ``AuditRow`` of one level and its summary: whole outputs compared with the reference's (see the package).
    ``judge``: the reference (``OracleJudge`` or ``ReferenceJudge``)."""
    from .. import metrics

    ref, stops, max_tokens = judge.refs, judge.stops, judge.max_tokens
    for i, a in enumerate(answers):
        if a.source is not None and a.prompt_mismatch is None:
            a.prompt_mismatch = judge.prompt_mismatch(i, a)
    compared = [i for i, a in enumerate(answers) if a.source is not None and ref[i] is not None]
    outs = [a.ids if a.source is not None else None for a in answers]
    cuts = [metrics.truncate(o, stops, max_tokens) if o is not None else [] for o in outs]
    divs, problems = _divergences(compared, outs, cuts, judge)
    unreferenced = sum(r is None for r in ref)
    signature = _signature(run, answers, divs, judge.records(run, cuts, _flagged(divs)), unreferenced)
    problems += [{"prompt": i, "kind": kind, "detail": why}
                 for i, a in enumerate(answers) for kind, why in a.problems()]
    problems.sort(key=lambda p: p["prompt"])
    row = _row(name, run, compared, outs, divs, signature, judge)
    sources = sorted({a.source for a in answers if a.source})
    level = {
        "concurrency": run.concurrency, "requests": len(answers), "compared": len(compared),
        "failed": sum(a.error is not None for a in answers),
        "protocol_errors": sum(a.protocol_error is not None for a in answers),
        "finish_mismatches": sum(a.finish_problem is not None for a in answers),
        "prompt_mismatches": sum(a.prompt_mismatch is not None for a in answers),
        "overruns": sum(d.cls == OVERRUN for d in divs), "unreferenced": unreferenced,
        "token_source": ", ".join(sources) if sources else None, "problems": problems, "seconds": run.seconds,
    }
    return row, level


def _divergences(compared, outs, cuts, judge) -> tuple[list, list[dict]]:
    """Each compared prompt's first divergence within the reference's length (attributed by ``judge``) and its
    overrun (tokens after the first stop token or beyond max_tokens), with a problem per overrun."""
    from .. import metrics

    ref, stops, max_tokens = judge.refs, judge.stops, judge.max_tokens
    divs, problems = [], []
    for i in compared:
        j = metrics.first_divergence(cuts[i], ref[i])
        if j is not None:
            divs.append(judge.divergence(i, cuts[i], j))
        k = len(cuts[i])
        if len(outs[i]) > k:
            divs.append(Divergence(i, k, None, None, OVERRUN, ref[i][k] if k < len(ref[i]) else None, outs[i][k]))
            after = "max_tokens" if k == max_tokens and cuts[i][-1] not in stops else f"the stop token {cuts[i][-1]}"
            extra = len(outs[i]) - k
            problems.append({"prompt": i, "kind": OVERRUN,
                             "detail": f"{extra} extra token{'s' if extra > 1 else ''} after {after}, from index {k}: "
                                       f"{short(outs[i][k:k + 8])}"})
    return divs, problems


def _flagged(divs) -> list:
    """The divergences the black-box signature weighs: synchronization, then unattributed."""
    return [d for d in divs if d.cls == "synchronization"] + [d for d in divs if d.cls == UNATTRIBUTED]


def _signature(run: ConcurrentRun, answers: list[Answer], divs, records, unreferenced: int) -> str:
    """The level's signature from its divergences (the audit's black-box signature of ``records``) and answers."""
    from .. import attribution as attr

    token_signature = attr.black_box_signature(run.concurrency, records,
                                               n_reference=sum(d.cls == "reference" for d in divs))
    if token_signature == "unknown" and any(d.cls == UNATTRIBUTED for d in divs) and not any(
            d.cls == "synchronization" for d in divs):
        token_signature = UNATTRIBUTED
    overruns = sum(d.cls == OVERRUN for d in divs)
    return verdict(answers, token_signature, overruns, unreferenced, len(answers) - unreferenced)


def _row(name, run: ConcurrentRun, compared, outs, divs, signature, judge):
    """The level's ``AuditRow``: the metrics over the compared answers."""
    from .. import metrics
    from ..report import AuditRow

    ref, m = judge.refs, len(compared)
    return AuditRow(
        engine=name, batch_size=run.concurrency, n=m,
        exact_match=sum(metrics.exact_match(outs[i], ref[i]) for i in compared) / m if m else 0.0,
        partial_match=sum(metrics.partial_match(outs[i], ref[i]) for i in compared) / m if m else 0.0,
        rouge_l=sum(metrics.rouge_l(outs[i], ref[i]) for i in compared) / m if m else 0.0,
        repetition_rate=metrics.repetition_rate([outs[i] for i in compared], judge.stops),
        divergences=divs, signature=signature, first_violated_invariant=None,
        tokens_per_second=sum(len(outs[i]) for i in compared) / run.seconds if run.seconds > 0 else 0.0,
        outputs=outs,
    )


def verdict(answers: list[Answer], token_signature: str, overruns: int, unreferenced: int = 0,
            referenced: int = 1) -> str:
    """The level's signature: the first that applies, in the order of the package's list."""
    if all(a.error for a in answers) or not referenced:
        return COULD_NOT_AUDIT
    checks = (
        (token_signature == REFERENCE, REFERENCE),
        (any(a.prompt_mismatch for a in answers), PROMPT_MISMATCH),
        (token_signature != "clean", token_signature),
        (overruns > 0, OVERRUN),
        (any(a.protocol_error or a.finish_problem for a in answers), PROTOCOL_ERROR),
        (any(a.error for a in answers) or unreferenced > 0, INCOMPLETE),
    )
    return next((signature for hit, signature in checks if hit), "clean")
