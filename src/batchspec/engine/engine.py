"""The engine: requests come in (``add_request``), each ``step`` runs one round on a batch of running rows (admit ->
select -> draft -> verify -> accept -> emit -> keep rows aligned) and says which tokens each request gained; rows
that finish (or are aborted) leave the batch."""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable

import torch

from ..batch import FEATURES, Batch, InvariantError, RoundLogprobs, Sequences, check_invariants, grammar, prefill
from ..batch.grammar import Grammars
from ..batch.prefilling import kept_tokens, prompt_chain, prompt_scores
from ..drafters.base import Proposal
from ..model.loading import vocab_size
from ..model.prefixes import BLOCK
from ..model.runner import Runner
from ..params import PROCESSORS, ParamError, Stats, TokenLogprob, check_prompt_logprobs, check_sampling
from ..sampling import Stream, greedy
from ..speculation import FixedLength
from ..speculation.budget import DRAFT, FIXED, NO_DRAFTER, NOT_WORTH, DraftBudget, Outcome, RoundView
from ..speculation.plan import with_forced
from .layouts.slotmask import SlotMask
from .memory import KVMemory
from .protocols import Drafter, Layout, Scheduler, SpeculationPolicy
from .readback import RoundReadback
from .verify import emitted_block, greedy_accept, rejection_sample

log = logging.getLogger("batchspec.engine")


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    stop_ids: set = field(default_factory=set)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    id: int | None = None  # given by ``Engine.add_request`` when None
    logprobs: int | None = None  # alternatives to return with each token's log-probability (None: none at all)
    cache_salt: str | None = None  # prompts share cached prefixes only with prompts of the same salt
    # logits processors (``SamplingParams``; these values turn each off)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    min_tokens: int = 0
    bad_words: list | None = None
    prompt_logprobs: int | None = None  # alternatives with each prompt token's log-probability (None: none at all)
    grammar: str | None = None  # structured output: llguidance's grammar text (``SamplingParams.structured``)
    matcher: object = None  # its state, made when the request joins (``Engine.add_request``)
    chain: list | None = None  # its prompt's block keys, once asked while it waits (``Engine._kept``)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_request(r: Request, vocab: int | None = None, context: int | None = None) -> None:
    """Raise ``ValueError`` unless ``r`` can run in a batch without failing it (and so the rows beside it): a
    non-empty prompt of integer ids inside the vocabulary, prompt + ``max_tokens`` inside ``context``, a seed, and
    sampling values inside ``SamplingParams``' bounds (``check_sampling``: its plain values replace ``r``'s).
    Cheap (one pass over the prompt); ``LLM.requests`` checks more (the draft's context, the dtype's smallest
    temperature)."""

    def refuse(what: str):
        return ValueError(f"request {r.id}: {what}")

    prompt = r.prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise refuse("the prompt must be a non-empty list of token ids")
    if not all(map(_is_int, prompt)) or min(prompt) < 0 or (vocab is not None and max(prompt) >= vocab):
        raise refuse(f"the prompt must hold integer token ids in [0, {vocab})")
    try:
        v = check_sampling(r.max_tokens, r.temperature, r.top_k, r.top_p, r.seed, r.stop_ids, r.logprobs,
                           vocab=vocab, **{name: getattr(r, name) for name in PROCESSORS})
        v["prompt_logprobs"] = check_prompt_logprobs(r.prompt_logprobs)
    except ParamError as e:
        raise ParamError(e.param, f"request {r.id}: {e}") from None
    if v["seed"] is None:
        raise refuse("seed must be an integer in [0, 2**63), got None (the engine draws none)")
    if context is not None and len(prompt) + v["max_tokens"] > context:
        raise refuse(f"{len(prompt)} prompt tokens + max_tokens {v['max_tokens']} exceed the context of {context}")
    r.max_tokens, r.temperature, r.top_k, r.top_p = v["max_tokens"], v["temperature"], v["top_k"], v["top_p"]
    r.seed, r.stop_ids, r.logprobs = v["seed"], set(v["stop_token_ids"]), v["logprobs"]
    r.prompt_logprobs = v["prompt_logprobs"]
    for name in PROCESSORS:
        setattr(r, name, v[name])


@dataclass
class Finished:
    request_id: int
    token_ids: list[int]
    reason: str  # "stop" | "length" | "abort" | "grammar" (a dead end of its grammar)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token of ``token_ids``, for requests that asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None first), for those that asked


@dataclass
class StepOutput:
    """What a step did for one request: the tokens it gained (with their ``TokenLogprob``, one each, when the request
    asked for log-probabilities), and its result when it finished in this step. ``prompt_logprobs``: on the
    request's first output, when it asked for them (``Request.prompt_logprobs``)."""

    request_id: int
    new_token_ids: list[int]
    finished: Finished | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Parts:
    """The swappable components of a round (an injected fault replaces exactly one of them; what each must provide:
    ``protocols.py``). ``target`` is the target's ``Runner``; ``policy`` chooses the speculation length of each round
    (``batchspec.speculation``)."""

    target: Runner
    drafter: Drafter
    layout: Layout
    k: int
    accept: Callable = greedy_accept
    sample: Callable = rejection_sample
    prefill: Callable = prefill
    policy: SpeculationPolicy = field(default_factory=FixedLength)
    context: int | None = None  # positions a verification block may reach (None: unlimited)
    grammars: Grammars | None = None  # matchers for structured output (None: requests with a grammar are refused)


class Timer:
    """Adds each stage's seconds to ``stats``. On CUDA the GPU is synchronised after a stage only when ``sync``
    (profiling): otherwise stage seconds are host seconds and the round keeps its one host read."""

    def __init__(self, stats: Stats, device: torch.device, sync: bool = False):
        self.stats, self.sync = stats, sync and device.type == "cuda"

    @contextmanager
    def __call__(self, stage: str):
        t = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        setattr(self.stats, stage, getattr(self.stats, stage) + time.perf_counter() - t)


@dataclass
class RoundResult:
    finished: torch.Tensor  # [rows of the batch] after the round
    block: torch.Tensor  # [B, k+1] emitted tokens (first ``emitted`` of each row)
    emitted: torch.Tensor  # [B]
    cut: torch.Tensor  # [B] verified tokens dropped after a stop token
    accepted: torch.Tensor  # [B] accepted drafts that were emitted
    n_drafts: torch.Tensor  # [B]
    kind: str | None = None  # the kind of round, for drafters whose rounds come in kinds (``Proposal.kind``)
    logprobs: RoundLogprobs | None = None  # for the rows that asked (``Sequences.logprobs``)
    dead: dict = field(default_factory=dict)  # rows whose grammar reached a dead end -> its position (``grammar``)
    forced: list[int] | None = None  # per row: the forced tokens it drafted first (``grammar.forced``), host


@dataclass
class RoundPlan:
    """What a round runs on, decided before it: ``rows`` of the window (None: every running row), ``k_max`` the most
    drafts a row may verify, and the round's ``budget``."""

    rows: list[int] | None
    k_max: int
    budget: DraftBudget
    room: int = 0  # the most forced tokens a row drafts (``grammar.forced``): k_max, or a few without a drafter


def speculative_round(parts: Parts, batch: Batch, timer: Timer, budget: DraftBudget, room: int = 0) -> RoundResult:
    """One round on a batch: draft (the plan the policy makes of the drafter's offer within ``budget``: up to
    ``budget.k`` tokens per row; first the tokens rows' grammars force, up to ``room``) -> verify -> accept -> hide
    rejected slots -> emit (with the log-probabilities of the emitted tokens, for rows that asked)."""
    seqs, target, drafter = batch.seqs, batch.target, parts.drafter
    with timer("draft"):  # the drafter offers, speculation plans, the drafter drafts exactly the plan (forced first)
        plan, forced = _plan(parts, batch, budget, room)
        if plan is not None and plan.width:
            proposal = drafter.propose(seqs, batch.draft, plan)
        else:
            proposal = Proposal.empty(len(seqs), seqs.length.device)
        drafts, n_drafts = proposal.drafts, proposal.n_drafts
        k = drafts.shape[1]  # this round's block: a drafter may propose fewer for every row
        legal, dead = None, {}
        if seqs.grammar_rows:  # the grammars' masks at every position, drafts cut before the first one forbidden
            legal, n_drafts, dead = grammar.masks(seqs, drafts, n_drafts, parts.grammars.vocab)
    with timer("verify"):
        # a row's slots past its own drafts are padding: hidden at once, and not computed where the runner packs
        out = target.append(torch.cat([seqs.pending()[:, None], drafts], 1), hidden=drafter.needs_hidden,
                            counts=n_drafts + 1)
        # each position's logits through the rows' processors, as at batch 1 (None: no row of the batch uses any)
        processed = seqs.process(out.logits, drafts) if seqs.processors else None
        if seqs.sampling:
            if legal is not None:  # the grammars' masks over a copy of the logits, at the positions they constrain
                processed = legal.masked(out.logits if processed is None else processed)
            u_accept, u_target = seqs.uniforms(k, Stream.ACCEPT), seqs.uniforms(k + 1, Stream.TARGET)
            target_p = seqs.warp(out.logits if processed is None else processed)
            accepted, bonus = parts.sample(target_p, proposal.q, drafts, n_drafts, u_accept, u_target)
        else:
            tokens = out.tokens() if processed is None else greedy(processed)
            if legal is not None:  # taken again under the masks where they forbid the argmax
                tokens = legal.greedy(tokens, lambda: out.logits if processed is None else processed)
            accepted, bonus = parts.accept(tokens, drafts, n_drafts)
    with timer("align"):
        if k:  # (a plain step's one slot stays visible)
            target.hide_tail(k + 1, accepted + 1)
        drafter.commit(batch.draft, proposal, accepted, out)
        block = emitted_block(drafts, accepted, bonus)
        logprobs = seqs.logprobs(out, block)
        parts.policy.record(seqs, accepted, k, plan, proposal, out)
        finished, n, cut = seqs.extend(block, accepted + 1)
        # count what was emitted: a round's first token is the target's own, drafts cut after a stop token or at
        # the limit are not counted (so generated tokens = accepted drafts + row-rounds)
        accepted = torch.minimum(accepted, n - 1)
        seqs.rounds += 1
        seqs.drafted += n_drafts
        seqs.accepted += accepted
    return RoundResult(finished, block, n, cut, accepted, n_drafts, proposal.kind, logprobs, dead, forced)


def _plan(parts: Parts, batch: Batch, budget: DraftBudget, room: int) -> tuple:
    """The round's ``DraftPlan`` (None: it drafts nothing) and the forced tokens each row drafts first (host counts,
    None: none): the policy's plan of the drafter's offer, widened to the tokens rows' grammars force
    (``grammar.forced``, up to ``room``) where the drafter takes them."""
    seqs, drafter = batch.seqs, parts.drafter
    plan = parts.policy.plan(drafter.offer(seqs, batch.draft, budget.k), budget) if budget.k else None
    if not (seqs.grammar_rows and drafter.takes_forced and room):
        return plan, None
    forced = grammar.forced(seqs, room, parts.grammars.vocab)
    if forced is None:
        return plan, None
    return with_forced(plan, *forced, budget.reason), forced[1]


def _room(parts: Parts, batch: Batch, k: int | None = None) -> int:
    """The most tokens any row may draft this round: K (or ``k``), clipped so the block stays inside the context (a
    running row always has room for one more position, as prompt + max_tokens fits the context)."""
    k = parts.k if k is None else k
    if parts.context is None or not k:
        return k
    return max(1, min(k, parts.context - max(batch.lengths)))


WINDOW = SlotMask(max_waste=0.5)
# a waiting prompt with at most this many tokens not kept (sent again; a conversation's next turn with a short new
# message; a short prompt) costs a copy and a forward of a few blocks, so it joins ahead of the prompts that cost a
# prefill, whose wait it lengthens by that little (``Engine._kept_first``; docs/benchmarks.md, serve-kept-first)
KEPT_FIRST = 128
KEPT_LOOK = 64  # waiting requests looked at for it (each: its kept blocks looked up, its keys hashed once)


class _PromptLengths(Sequence):
    """The prompt tokens the waiting requests' prefills would compute, in order (``costs`` of the first ones, the
    others' whole prompts), read only as far as the scheduler looks."""

    def __init__(self, waiting: deque[Request], costs: list[int]):
        self.waiting, self.costs = waiting, costs

    def __len__(self) -> int:
        return len(self.waiting)

    def __getitem__(self, i: int) -> int:
        return self.costs[i] if i < len(self.costs) else len(self.waiting[i].prompt)


class Engine:
    """Runs requests through rounds. ``add_request`` queues a request and returns its id; ``step`` runs one round
    (admitting waiting requests first, as the scheduler says) and returns a ``StepOutput`` per request that gained
    tokens or finished; ``abort`` drops a request; ``has_work`` says whether a step would do anything.

    The scheduler decides at each step how many waiting requests join (``admit``) and which running rows form the
    round's batch (``select``; the others wait in the window). If a step raises, the engine drops every request
    (running and waiting) and stays usable."""

    def __init__(self, parts: Parts, scheduler: Scheduler, batch_size: int, stats: Stats | None = None,
                 check: bool = False, profile: bool = False, prefill_tokens: int | None = None,
                 kv_memory: int | None = None, prefill_chunk: int | None = None):
        """``prefill_tokens``: while rows are running, the prompt tokens a step prefills at most (the scheduler's
        ``admit`` token budget: at least one request joins; None: every request the scheduler has room for).
        ``prefill_chunk``: while rows are running, a prompt with more tokens not kept yet is prefilled this many a
        step before it joins (``_ahead``; None: whole).
        ``kv_memory``: bytes of keys and values the running rows may take at their widest (``memory.KVMemory``:
        requests wait until they fit, one that never could is refused; None: no bound)."""
        self.parts, self.batch_size, self.check = parts, batch_size, check
        self.prefill_tokens, self.prefill_chunk = prefill_tokens, prefill_chunk
        self.scheduler = copy.deepcopy(scheduler)  # a scheduler may remember rows: one per engine
        windowed = scheduler.room(0, batch_size) > batch_size  # rounds drawn from a window of rows
        self.memory = KVMemory.of(parts, kv_memory, batch_size if windowed else None, WINDOW.max_waste)
        self.stats = stats if stats is not None else Stats()
        self.timer = Timer(self.stats, parts.target.device, profile)
        self.waiting: deque[Request] = deque()
        self.batch: Batch | None = None
        self.rounds = 0
        self._next_id = 0
        self._aborted: set[int] = set()
        self._done: list[StepOutput] = []  # results to hand out at the next step (requests aborted while waiting)
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # per running request that asked: its tokens' so far
        self._prompt_lps: dict[int, list] = {}  # per running request that asked: its prompt tokens' (for ``Finished``)
        self._prompt_unsent: dict[int, list] = {}  # ... until its first ``StepOutput`` carries them
        self._ends: dict[int, str] = {}  # finish reasons of rows their grammar ended, until they leave
        self._chunked: dict[int, int] = {}  # waiting requests prefilled in chunks: the tokens kept so far (``_ahead``)
        model = getattr(parts.target, "model", None)
        self._vocab = vocab_size(model) if model is not None else None
        scheduler.forget([])

    # ---------------------------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> int:
        """Queue ``request`` (its id given here when None). A request the batch could not run (``check_request``)
        raises ``ValueError`` here and never joins, so it cannot fail the rows beside it."""
        check_request(request, self._vocab, self.parts.context)
        if request.grammar is not None:
            if self.parts.grammars is None:
                raise ParamError("grammar", f"request {request.id}: structured output needs a tokenizer")
            request.matcher = self.parts.grammars.matcher(request.grammar)
        refusal = self.memory.refusal(len(request.prompt), request.max_tokens)
        if refusal is not None:
            raise ValueError(f"request {request.id}: {refusal}")
        if request.id is None:
            request.id = self._next_id
        elif any(r.id == request.id for r in self.waiting) or (
                self.batch is not None and request.id in self.batch.request_ids):
            raise ValueError(f"request id {request.id} is already in use")
        self._next_id = max(self._next_id, request.id + 1)
        self.waiting.append(request)
        return request.id

    def abort(self, request_id: int) -> bool:
        """Drop a request: a waiting one at once, a running one at the start of the next step (its ``StepOutput``
        then carries a ``Finished`` with reason "abort" and the tokens it had). False if the id is unknown."""
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                self._chunked.pop(r.id, None)
                lps = None if r.logprobs is None else []
                self._done.append(StepOutput(r.id, [], Finished(r.id, [], "abort", logprobs=lps), lps))
                return True
        if self.batch is not None and request_id in self.batch.request_ids:
            self._aborted.add(request_id)
            return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.batch is not None or self._done)

    def reset(self) -> None:
        """Drop every request and all per-batch state (target, drafter and scheduler)."""
        self.waiting.clear()
        self.batch = None
        self._aborted.clear()
        self._done = []
        self._logprobs, self._prompt_lps, self._prompt_unsent = {}, {}, {}
        self._ends, self._chunked = {}, {}
        self.scheduler.forget([])

    # ---------------------------------------------------------------------------------------------- the loop
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One round: schedule (aborted rows leave, waiting requests join, the scheduler picks the round's rows and
        the policy its budget) -> run (draft, verify, accept, emit) -> postprocess (the round's one host read,
        counters, finished rows leave, the caches realigned). If it raises, the engine drops every request (running
        and waiting) and stays usable."""
        try:
            outs, plan = self._schedule()
            if plan is not None:
                result = self._run(plan)
                self.memory.measure(self.batch, self.parts.drafter, self.stats)  # the round's block appended
                outs += self._postprocess(plan, result)
            self.memory.measure(self.batch, self.parts.drafter, self.stats)
            return outs
        except BaseException:
            self.reset()
            raise

    def _schedule(self) -> tuple[list[StepOutput], RoundPlan | None]:
        """Before the round: the results of aborted requests, waiting requests admitted (``_admit``), then the
        round's rows (the scheduler's ``select``) and its budget. No plan when no row is running."""
        outs, self._done = self._done, []
        outs += self._drop_aborted()
        self._admit()
        if self.batch is None:
            return outs, None
        self.rounds += 1
        rows, grouped = self.scheduler.select(self.batch.lengths, self.batch_size)
        if grouped is not None:
            self.stats.grouped_rounds += grouped
            self.stats.fallback_rounds += not grouped
        k_max = _room(self.parts, self.batch)
        room = k_max if self.parts.k else _room(self.parts, self.batch, grammar.FORCED_MOST)
        if rows is None:
            return outs, RoundPlan(rows, k_max, self._budget(self.batch, k_max), room)
        # rounds drawn from a window keep every row's draft state in step: fixed length
        return outs, RoundPlan(rows, k_max, DraftBudget(k_max, reason=FIXED), room)

    def _drop_aborted(self) -> list[StepOutput]:
        """Take the running rows whose request was aborted out of the batch; their results."""
        if not self._aborted or self.batch is None:
            return []
        gone = [rid in self._aborted for rid in self.batch.request_ids]
        self._aborted.clear()
        return [StepOutput(f.request_id, [], f, None if f.logprobs is None else [])
                for f in self._remove(gone, reason="abort")]

    def _run(self, plan: RoundPlan) -> RoundResult:
        """The round itself: on every running row, or on the rows of the window the scheduler chose."""
        if plan.rows is None:
            return speculative_round(self.parts, self.batch, self.timer, plan.budget, plan.room)
        return self._round_from_window(plan.rows, plan.budget, plan.room)

    def _postprocess(self, plan: RoundPlan, result: RoundResult) -> list[StepOutput]:
        """After the round: its one host read, the counters and the policy's observation, a ``StepOutput`` per row of
        the round, finished rows out, the caches realigned and (with ``check``) the invariants checked."""
        batch, stats, policy = self.batch, self.stats, self.parts.policy
        widest = result.block.shape[1] - 1  # the drafts of the row that drafted most
        stats.lengths[widest] = stats.lengths.get(widest, 0) + 1
        with self.timer("align"):
            # per-row acceptance estimates, for the policy's own choice, read only after rounds that drafted (a round
            # without drafting leaves them)
            estimates = policy.estimates(batch.seqs, self.parts.k) if plan.rows is None and plan.budget.k else None
            read = RoundReadback.read(batch.seqs, result, estimates)  # the one host read
            if result.forced is not None:
                _count_forced(stats, result.forced, read.emitted)
            if batch.seqs.grammar_rows:
                self._grammar_ends(read, plan.rows, result.dead)
            batch.lengths = read.lengths
            _tally(stats, read)
            new = self._outputs(read, plan.rows, result.logprobs)
            outcome = Outcome(len(result.emitted), plan.k_max, plan.budget, read.drafted, result.kind, read.estimates)
            policy.observe(outcome)
            _count(stats, outcome)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("round %d: %d rows, budget k=%d%s (%s), drafted %d%s", self.rounds, outcome.rows,
                          plan.budget.k, " per row" if plan.budget.per_row else "", plan.budget.reason, read.drafted,
                          f", a {result.kind} round" if result.kind else "")
            if any(read.finished):
                by_id = {o.request_id: o for o in new}
                for f in self._remove(read.finished):
                    by_id[f.request_id].finished = f
            if self.batch is not None:
                # a window keeps the layout's slots between batches; its waste is bounded like slotmask's
                layout = self.parts.layout if plan.rows is None else WINDOW
                for state in self._slot_states():
                    layout.align(state, read.width)
        if self.check and self.batch is not None:
            check_round(self.parts.drafter, self.batch, self.rounds)
        return new

    def _grammar_ends(self, read: RoundReadback, rows: list[int] | None, dead: dict) -> None:
        """The matchers take the round's tokens; rows whose grammar is complete or at a dead end finish here, the
        tokens after that point dropped (``grammar.advance``)."""
        seqs = self.batch.seqs
        rows = list(range(len(read.emitted))) if rows is None else rows
        for i, (kept, reason) in grammar.advance(seqs, rows, read.emitted, read.block, dead).items():
            r, dropped = rows[i], read.emitted[i] - kept
            if dropped:
                seqs.length[r] -= dropped
                read.lengths[r] -= dropped
                read.emitted[i], read.generated = kept, read.generated - dropped
            read.finished[r] = True
            self._ends[seqs.request_ids[r]] = reason
        read.width = max((n - 1 for n, f in zip(read.lengths, read.finished) if not f), default=0)

    def _outputs(self, read: RoundReadback, rows: list[int] | None, lp: RoundLogprobs | None) -> list[StepOutput]:
        """A ``StepOutput`` per row of the round's batch (``rows`` of the window, or every running row) with its new
        tokens and, for rows that asked, their log-probabilities (also kept for the request's ``Finished``)."""
        ids = self.batch.request_ids if rows is None else [self.batch.request_ids[i] for i in rows]
        new = [StepOutput(rid, read.block[i][: read.emitted[i]], prompt_logprobs=self._prompt_unsent.pop(rid, None))
               for i, rid in enumerate(ids)]
        if lp is not None:
            for i, (row, keep) in enumerate(zip(lp.rows, lp.tops)):
                out = new[row]
                chosen, top_ids, top_values = read.chosen[i], read.top_ids[i], read.top_values[i]
                out.logprobs = [TokenLogprob(tok, chosen[j], list(zip(top_ids[j][:keep], top_values[j][:keep])))
                                for j, tok in enumerate(out.new_token_ids)]
                self._logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        return new

    def _budget(self, batch: Batch, k_max: int) -> DraftBudget:
        """The round's budget, from the policy (a query)."""
        if not self.parts.k:
            return DraftBudget.plain(NO_DRAFTER)
        packed = batch.target.runner.packed_rows if self.parts.drafter.packs_rows else 0
        view = RoundView(len(batch), k_max, batch.seqs, bool(self.waiting), packed)
        return self.parts.policy.budget(view)

    def _slot_states(self):
        return (self.batch.target, *self.parts.drafter.states(self.batch.draft))

    def _admit(self) -> None:
        """Prefill the waiting requests the scheduler admits and merge them into the running batch (or the first one's
        next chunk, ``_ahead``); what the kept prefixes gave counted in ``Stats``."""
        kept = getattr(self.parts.target, "prefixes", None)
        before = (kept.hits, kept.reused, kept.evictions) if kept is not None else None
        self._join()
        if before is not None:
            self.stats.prefix_hits += kept.hits - before[0]
            self.stats.prefix_tokens += kept.reused - before[1]
            self.stats.prefix_evictions += kept.evictions - before[2]

    def _join(self) -> None:
        """The admission itself: the scheduler's count (within the KV budget) joins, prefilled and merged."""
        running = len(self.batch) if self.batch is not None else 0
        costs = self._costs() if self.scheduler.room(running, self.batch_size) > 0 else []
        cheap = self._kept_first(costs) if getattr(self.scheduler, "joins_running", True) else 0
        fits = self.memory.admits(self.batch.request_ids if self.batch is not None else [], self.waiting)
        n = self.scheduler.admit(running, _PromptLengths(self.waiting, costs), self.batch_size, self.prefill_tokens,
                                 fits)
        n = min(n, cheap) if cheap else n  # the cheap ones in a prefill of their own: theirs takes no longer
        skip, n = self._ahead(n) if n > 0 else (0, 0)
        if n <= 0:
            return
        held = [self.waiting.popleft() for _ in range(skip)]  # a long prompt prefilled a chunk further: it waits
        joins = [self.waiting.popleft() for _ in range(n)]
        self.waiting.extendleft(held)
        for r in joins:
            self._chunked.pop(r.id, None)
        self.memory.joined(joins)
        # joining a running batch: cached now, unless the drafter is dry (then caught up when it next runs)
        joining = self.batch is not None and not self.parts.policy.dry()
        with self.timer("prefill"):
            # requests that asked for prompt log-probabilities are prefilled apart (every position computed, with its
            # hidden states), so the others' prefill is what it would be without them
            groups = [[r for r in joins if (r.prompt_logprobs is not None) == scored] for scored in (False, True)]
            parts = [self._prefilled(rows, bool(scored), joining) for scored, rows in enumerate(groups) if rows]
            new = parts[0] if len(parts) == 1 else parts[0].merge(parts[1])
            if self.batch is None:
                self.batch = new
            else:
                self.stats.joined_running += n
                self.batch = self.batch.merge(new)

    def _costs(self) -> list[int]:
        """The prompt tokens each of the first ``KEPT_LOOK`` waiting requests would compute (not those kept; all of
        them for one that asked for its prompt's log-probabilities), where two or more wait. A query of the kept
        prefixes; each prompt's block keys are hashed once while it waits."""
        costs = []
        if len(self.waiting) < 2 or getattr(self.parts.target, "prefixes", None) is None:
            return costs  # one joins whatever it costs; without kept prefixes each costs its prompt
        for r in islice(self.waiting, KEPT_LOOK):
            cost = len(r.prompt)
            if cost > KEPT_FIRST and r.prompt_logprobs is None:
                cost -= self._kept(r)
            costs.append(cost)
        return costs

    def _kept(self, r: Request) -> int:
        """How many of waiting ``r``'s prompt tokens its prefill would take from the kept prefixes (``kept_tokens``;
        its block keys hashed once while it waits). A query."""
        target = self.parts.target
        if r.chain is None:
            r.chain = prompt_chain(target, r.prompt, r.cache_salt)
        return kept_tokens(target, r.prompt, r.chain, self.parts.drafter.needs_hidden)

    def _kept_first(self, costs: list[int]) -> int:
        """The waiting requests that cost at most ``KEPT_FIRST`` tokens to prefill move ahead of those that cost more
        (``costs``, reordered with them), each group in its order of arrival; counted in ``Stats.kept_first``.
        Returns how many cheap ones lead the queue where a costly one waits behind them (they join alone: their
        first tokens do not wait for its prefill), else 0."""
        cheap = [c <= KEPT_FIRST for c in costs]
        if all(cheap) or not any(cheap):
            return 0
        moved = sum(cheap[cheap.index(False):])
        if moved:
            order = sorted(range(len(costs)), key=lambda i: not cheap[i])  # stable: each group in its order
            mine = list(islice(self.waiting, len(costs)))
            for _ in mine:
                self.waiting.popleft()
            self.waiting.extendleft(mine[i] for i in reversed(order))
            costs[:] = [costs[i] for i in order]
            self.stats.kept_first += moved
        return sum(cheap)

    def _ahead(self, n: int) -> tuple[int, int]:
        """Of the ``n`` requests the scheduler admits, ``(skip, join)``: the first ``skip`` (0 or 1) wait, prefilled a
        chunk further, and the next ``join`` join now. While rows run, a prompt whose tokens not kept yet exceed
        ``prefill_chunk`` has its next chunk computed into the target's kept prefixes (``Runner.prefixes``: from its
        longest kept start, so each chunk starts where the last one ended, with the bits one piece would give) and
        joins at the step where what is left fits; the requests behind it join meanwhile, up to the next such prompt.
        A long prompt then holds the running rows back a chunk at a time."""
        if self.batch is None or not self.prefill_chunk:
            return 0, n
        skip, upto = 0, self._chunk(self.waiting[0])
        if upto is not None:
            with self.timer("prefill"):
                r, hidden = self.waiting[0], self.parts.drafter.needs_hidden
                state = self.parts.prefill(self.parts.target, [r.prompt[: upto + 1]], hidden=hidden and FEATURES,
                                           salts=[r.cache_salt])
                (state[0] if hidden else state).cache.release()
            self._chunked[r.id] = upto  # where its next chunk starts: blocks dropped meanwhile end the chunking
            self.stats.prefill_chunks += 1
            skip = 1
        stop = next((i for i in range(1, n) if self._chunk(self.waiting[i]) is not None), n)
        return skip, stop - skip

    def _chunk(self, r: Request) -> int | None:
        """Where the next chunk of ``r``'s prompt ends (its tokens kept up to there), or None where it joins whole: a
        prompt with at most ``prefill_chunk`` tokens not kept, one scored in full, one whose last chunk was not kept
        (no room), and wherever nothing is kept. A query."""
        target, budget = self.parts.target, self.prefill_chunk
        if len(r.prompt) - 1 <= budget or r.prompt_logprobs is not None or getattr(target, "prefixes", None) is None:
            return None  # (a short prompt's blocks are not even looked up)
        have = self._kept(r)
        upto = (have + budget) // BLOCK * BLOCK
        if len(r.prompt) - 1 - have <= budget or have < self._chunked.get(r.id, 0) or upto <= have:
            return None
        return upto

    def _prefilled(self, joins: list[Request], scored: bool, joining: bool) -> Batch:
        """The rows of ``joins`` prefilled (target and drafter). ``scored``: they asked for prompt log-probabilities,
        computed from the prefill's hidden states at every prompt position (no cached start: ``prefill``'s
        ``fresh``) and kept for their outputs."""
        prompts, drafter = [r.prompt for r in joins], self.parts.drafter
        salts = [r.cache_salt for r in joins]
        if drafter.needs_hidden or scored:  # a drafter that reads the target's features starts from the prompt's
            target, states = self.parts.prefill(self.parts.target, prompts, hidden=scored or FEATURES, salts=salts,
                                                fresh=scored)
            if drafter.needs_hidden:
                draft = drafter.prefill(prompts, states, joining=joining)
            else:
                draft = drafter.prefill(prompts)
            if scored:
                self._score_prompts(joins, states)
        else:
            target, draft = self.parts.prefill(self.parts.target, prompts, salts=salts), drafter.prefill(prompts)
        return Batch(Sequences(joins, self.parts.k, self.parts.target.device), target, draft,
                     [len(p) for p in prompts])

    def _score_prompts(self, joins: list[Request], states) -> None:
        """Each request's prompt log-probabilities (``prompt_scores``, read back at admission), kept for its outputs."""
        chosen = rank = ids = values = []
        if any(len(r.prompt) > 1 for r in joins):  # else every prompt is one token: nothing to score
            k = max(r.prompt_logprobs for r in joins)
            scores = prompt_scores(self.parts.target, [r.prompt for r in joins], states, k)
            chosen, rank, ids, values = (t.tolist() for t in scores)
        at = 0
        for r in joins:
            n, keep = len(r.prompt) - 1, r.prompt_logprobs
            entries = [None] + [TokenLogprob(t, chosen[i], list(zip(ids[i][:keep], values[i][:keep])), rank[i])
                                for t, i in zip(r.prompt[1:], range(at, at + n))]
            self._prompt_lps[r.id] = self._prompt_unsent[r.id] = entries
            at += n

    def _round_from_window(self, rows: list[int], budget: DraftBudget, room: int) -> RoundResult:
        """A round on ``rows`` of the window: copy them out (aligned by the layout), run the round, write them back.
        ``finished`` of the result is spread over every window row."""
        window = self.batch
        with self.timer("schedule"):
            part = window.take(rows)
            width = max(window.lengths[r] for r in rows) - 1
            for state in (part.target, *self.parts.drafter.states(part.draft)):
                self.parts.layout.align(state, width)
        result = speculative_round(self.parts, part, self.timer, budget, room)
        with self.timer("schedule"):
            window.put(rows, part)
            idx = torch.tensor(rows, device=result.finished.device)
            result.finished = torch.zeros(len(window), dtype=torch.bool, device=idx.device).index_copy(
                0, idx, result.finished)
        return result

    def _remove(self, gone: list[bool], reason: str | None = None) -> list[Finished]:
        """Take rows flagged in ``gone`` out of the batch; returns their results. The last surviving rows move into
        the places of leaving ones, so removing rows moves few of them."""
        done = _collect(self.batch.seqs, gone, reason)
        for f in done:
            f.reason = self._ends.pop(f.request_id, f.reason)
        for f in done:
            if f.logprobs is not None:
                f.logprobs = self._logprobs.pop(f.request_id, [])
            f.prompt_logprobs = self._prompt_lps.pop(f.request_id, None)
            self._prompt_unsent.pop(f.request_id, None)
        keep = _refill_from_tail(gone)
        self.scheduler.forget(keep)
        if keep:
            self.batch.select_rows(keep)
        else:
            for state in self._slot_states():  # its buffers serve the next batch (and its graphs, on a GPU)
                state.cache.release()
            self.batch = None
        return done


def _tally(stats: Stats, read: RoundReadback) -> None:
    """Add what the round did to the global counters."""
    stats.generated += read.generated
    stats.drafted += read.drafted
    stats.accepted += read.accepted
    stats.ragged_rounds += read.accepted_max > read.accepted_min >= 0
    stats.full_accepts += read.full_accepts
    stats.dropped_after_stop += read.cut
    stats.rounds += 1
    stats.verify_calls += 1
    stats.row_rounds += len(read.emitted)


def _count_forced(stats: Stats, forced: list[int], emitted: list[int]) -> None:
    """Count the forced drafts the round verified and those its rows emitted (before any cut, a row's accepted
    drafts are its emitted tokens but the bonus)."""
    stats.forced_rounds += 1
    stats.forced_drafted += sum(forced)
    stats.forced_accepted += sum(min(f, n - 1) for f, n in zip(forced, emitted))


def _count(stats: Stats, outcome: Outcome) -> None:
    """Count the round by what decided it (``Stats.decisions``; a budget the drafter sized to nothing counts as
    "not-worth-it") and by its kind (``Stats.kinds``)."""
    b = outcome.budget
    reason = NOT_WORTH if b.reason == DRAFT and not outcome.drafted else b.reason
    stats.decisions[reason] = stats.decisions.get(reason, 0) + 1
    if outcome.kind is not None:
        stats.kinds[outcome.kind] = stats.kinds.get(outcome.kind, 0) + 1


def _refill_from_tail(fin: list) -> list[int]:
    """The rows that stay, as ``new[i] = old[keep[i]]``: rows keep their place, and the last surviving rows move into
    the places of finished ones."""
    n = len(fin) - sum(fin)
    keep = list(range(n))
    holes = [i for i in range(n) if fin[i]]
    movers = [i for i in range(n, len(fin)) if not fin[i]]
    for h, m in zip(holes, movers):
        keep[h] = m
    return keep


def _collect(seqs: Sequences, fin: list, reason: str | None) -> list[Finished]:
    rows = [i for i, f in enumerate(fin) if f]
    idx = torch.tensor(rows, device=seqs.length.device)
    hist = seqs.history[idx].tolist()
    start, end = seqs.prompt_len[idx].tolist(), seqs.length[idx].tolist()
    stopped, rounds = seqs.stopped[idx].tolist(), seqs.rounds[idx].tolist()
    drafted, accepted = seqs.drafted[idx].tolist(), seqs.accepted[idx].tolist()
    return [
        Finished(seqs.request_ids[r], hist[j][start[j] : end[j]], reason or ("stop" if stopped[j] else "length"),
                 rounds[j], drafted[j], accepted[j], None if seqs.top_logprobs[r] is None else [])
        for j, r in enumerate(rows)
    ]


def check_round(drafter, batch: Batch, rnd: int) -> None:
    """Assert I1 and I2 on the target cache and on the drafter's caches (if any)."""
    seqs = batch.seqs
    check_invariants(batch.target, seqs.history, seqs.length - 1, rnd)
    states = drafter.states(batch.draft)
    for state in states:
        check_invariants(state, seqs.history, drafter.processed(seqs, batch.draft), rnd)
    for state in (batch.target, *states):
        if state.valid.shape[0] != len(seqs):
            raise InvariantError("I1", "shape", f"cache has {state.valid.shape[0]} rows, batch has {len(seqs)}", None,
                                 rnd, state.name)
