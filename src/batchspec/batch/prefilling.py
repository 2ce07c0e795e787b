"""The prefill: each prompt's tokens through the target (or a draft model) once, into a new ``SlotState`` whose rows are
left-padded to one width; prompts of similar length share a forward, a start the prompts share (or one the runner has
kept) is computed once."""

from __future__ import annotations

import torch

from ..model import kv
from ..model.prefill import FEATURES
from ..model.prefixes import BLOCK, Prefix, block_keys
from ..model.runner import Runner
from .slots import SlotState, compact_index


# a forward's fixed cost, in tokens' worth of work (other devices: 1). CPU: a 64-token prefill forward took ~30 tokens'
# time more than its share of a 1024-token one, and 16 built-in chat prompts (862 tokens) prefilled 1.35x as fast grouped
# with 16-128 as without (docs/benchmarks.md)
PREFILL_OVERHEAD = {"cuda": 4096, "cpu": 32}
PREFILL_MAX_TOKENS = 1 << 16  # padded tokens per prefill forward at most (bounds its activations)
# leading tokens the prompts of a prefill must share before that prefix is computed once for all of them (a chat
# template's system prompt: 24 tokens for SmolLM2's, 40% of the built-in chat prompts' tokens); below it, one more
# forward and the copies of its keys and values cost about what sharing saves
SHARED_PREFIX_MIN = 16


def prefill_groups(lengths: list[int], overhead: int, max_tokens: int = PREFILL_MAX_TOKENS) -> list[list[int]]:
    """Split rows into groups, one left-padded forward each, minimising the sum over groups of ``overhead + rows x
    longest``: with a small overhead (CPU) rows of equal length share a forward and nothing is padded; with a large
    one (a GPU, where a forward's launches cost more than thousands of tokens' arithmetic) few forwards take all."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # best[j]: the cheapest split of the j shortest rows
        longest = lengths[order[j - 1]]
        for i in range(j - 1, -1, -1):
            if i < j - 1 and (j - i) * longest > max_tokens:
                break
            cost = best[i] + overhead + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens all of ``prompts`` share."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


def _prefix(runner, prefix: list[int], hidden: bool, base: Prefix | None = None):
    """The forward of a prefix shared by every prompt of a prefill, once: its one-row cache and, with ``hidden``, its
    final hidden states ``[1, P, H]``. ``base``: a kept prefix of its first tokens, copied; only the rest is
    computed."""
    dev = runner.device
    cache = kv.new_cache(runner.model)
    start = 0 if base is None else len(base)
    if base is not None:
        for layer, k, v in zip(cache.layers, base.keys, base.values):
            layer.lazy_initialization(k, v)
            layer.set(k, v)
        if start == len(prefix):
            return cache, base.hidden
    visible = None if base is None else torch.ones((1, len(prefix)), dtype=torch.bool, device=dev)
    out = runner.forward(cache, torch.tensor([prefix[start:]], device=dev),
                         torch.arange(start, len(prefix), device=dev)[None, :], visible, logits_to_keep=1,
                         hidden="all" if hidden else False)
    if not hidden or base is None:
        return cache, out.hidden
    return cache, torch.cat([base.hidden, out.hidden], 1)


def _prefill_group(runner, cached: list[list[int]], prefix, shared: int, hidden: bool, inputs=None):
    """One group's forward: its rows' tokens ``cached[r][shared:]``, left-padded, after the shared prefix when there
    is one (``prefix`` from ``_prefix``: its keys and values copied for each row, attended to by every row; each row's
    slots are then right-aligned, prefix first). Returns the group's cache and, with ``hidden``, its final hidden
    states ``[R, n, H]`` laid out like its slots (zeros on padding). ``inputs``: input vectors in place of the token
    embeddings (only without a prefix)."""
    dev, rows = runner.device, len(cached)
    m = max(len(c) for c in cached) - shared
    pad = torch.tensor([m - (len(c) - shared) for c in cached], device=dev)[:, None]
    col = torch.arange(m, device=dev)[None, :]
    ids = torch.tensor([[0] * (m - len(c) + shared) + c[shared:] for c in cached], device=dev)
    if prefix is None:
        part = kv.new_cache(runner.model)
        visible = None if not pad.any() else col >= pad  # one host read per group, at prefill only
    else:
        part = kv.take_rows(prefix[0], torch.zeros(rows, dtype=torch.long, device=dev))
        visible = torch.cat([torch.ones((rows, shared), dtype=torch.bool, device=dev), col >= pad], 1)
    out = runner.forward(part, ids, shared + (col - pad).clamp(min=0), visible, logits_to_keep=1,
                         hidden="all" if hidden else False, embeds=inputs)
    if prefix is None:
        h = out.hidden if visible is None or not hidden else out.hidden.masked_fill(~visible[..., None], 0)
        return part, h
    index, hole = compact_index(visible, shared + m)
    kv.gather_slots(part, index, hole)
    if not hidden:
        return part, None
    states = torch.cat([prefix[1].expand(rows, -1, -1), out.hidden], 1)
    return part, states.gather(1, index[..., None].expand(-1, -1, states.shape[-1])).masked_fill(hole[..., None], 0)


def _grouped(runner, prompts, lengths, shared, width, overhead, hidden, embeds, base=None, few=False):
    """The prefill as one left-padded forward per group of rows (``prefill_groups``), after the shared prefix's own
    forward (from ``base`` on, a kept prefix of its first tokens); returns ``(cache, states)`` like
    ``Runner.prefill``: the hidden states ``[B, width, H]`` or None."""
    dev, states = runner.device, None
    cache = kv.new_cache(runner.model)
    prefix = _prefix(runner, prompts[0][:shared], hidden, base) if shared else None
    # ``few``: rows the C layer computes, each forward within the tokens it takes (``packed_rows``)
    most = runner.packed_rows if few and runner.packed_rows else PREFILL_MAX_TOKENS
    for rows in prefill_groups([n - shared for n in lengths], overhead, most):
        rows = [r for r in rows if lengths[r]]
        if not rows:
            continue
        n = max(lengths[r] for r in rows)
        inputs = embeds(rows, n) if embeds is not None else None
        part, h = _prefill_group(runner, [prompts[r][: lengths[r]] for r in rows], prefix, shared, hidden, inputs)
        index = torch.tensor(rows, device=dev)
        kv.place_rows(cache, index, part, len(prompts), width)
        if hidden:
            if states is None:
                states = h.new_zeros((len(prompts), width, h.shape[-1]))
            states[index, width - n:] = h
        part.release()
    if prefix is not None:
        prefix[0].release()
    return cache, states


def _prefill(runner, prompts, lengths, width, overhead, hidden, embeds, base, whole):
    """``(cache, states or None)`` of ``prompts`` (``lengths``: each one's cached tokens) right-aligned in ``width``
    slots, every one starting from ``base`` (a cached ``Prefix`` of each, or None): ``prefill`` for one start and one
    path (``whole``: ``Runner.whole`` of each; else the grouped forwards)."""
    # the prefix every prompt shares, up to each row's last cached token (every row keeps one of its own): computed
    # once where that saves more than a forward's overhead
    cached = [p[:n] for p, n in zip(prompts, lengths)]
    shared = 0
    if embeds is None and len(prompts) > 1 and min(lengths) > 0:
        shared = min(shared_prefix(cached), min(lengths) - 1)
        if shared < SHARED_PREFIX_MIN or (len(prompts) - 1) * shared <= overhead:
            shared = 0
    if base is not None:
        shared = max(shared, len(base))

    def vectors():  # each row's input vectors [n, H] for the end-to-end forward, asked for once per row length
        out = [None] * len(prompts)
        for n in set(lengths) - {0}:
            rows = [r for r, m in enumerate(lengths) if m == n]
            for r, v in zip(rows, embeds(rows, n)):
                out[r] = v
        return out

    done = runner.prefill(cached, shared, width, hidden, vectors if embeds is not None else None, base) if whole else None
    return done or _grouped(runner, prompts, lengths, shared, width, overhead, hidden, embeds, base, not whole)


def _fits(runner, entry: Prefix | None) -> bool:
    """Whether a kept start still fits the model (not moved or cast since it was kept)."""
    return entry is None or (entry.keys[0].device == runner.device and entry.keys[0].dtype == runner.model.dtype)


def _starts(store, runner, cached, chains, hidden) -> list:
    """Each row's longest cached start (a ``Prefix``, one object per distinct start) or None. The cache is dropped
    when what it holds no longer fits the model (moved or cast since)."""
    starts, seen = [], {}
    for tokens, chain in zip(cached, chains):
        entry = store.find(tokens, chain, hidden)
        if entry is not None:
            entry = seen.setdefault(entry.chain[-1], entry)
        starts.append(entry)
    if not _fits(runner, next((s for s in starts if s is not None), None)):
        store.clear()
        return [None] * len(cached)
    return starts


def _copied(runner, starts: list[Prefix], width: int, hidden: bool):
    """Rows every one of whose tokens is kept (prompts sent again): their kept keys and values (and hidden states)
    copied into one rectangle of ``width`` slots, nothing computed. The values are those the prompts' first prefill
    gave, so the rows are what computing them again would give (a row's path follows its own length)."""
    cache, states = kv.new_cache(runner.model), None
    for r, start in enumerate(starts):
        part, h = _prefix(runner, list(start.tokens), hidden, start)  # (the whole prefix given: no forward)
        kv.place_rows(cache, torch.tensor([r], device=runner.device), part, len(starts), width)
        if hidden:
            if states is None:
                states = h.new_zeros((len(starts), width, h.shape[-1]))
            states[r, width - len(start) :] = h[0]
        part.release()
    return cache, states


def _by_group(runner, prompts, lengths, width, overhead, hidden, embeds, starts, paths, groups):
    """The prefill of rows in several ``groups`` (a path and a cached start each): each prefilled from its start
    (``_prefill``), their rows copied into one rectangle of ``width`` slots."""
    dev = runner.device
    cache, states = kv.new_cache(runner.model), None
    for rows in groups:
        n = max(lengths[r] for r in rows)
        if not n:
            continue
        inputs = None if embeds is None else (lambda picked, m, rows=rows: embeds([rows[i] for i in picked], m))
        part, h = _prefill(runner, [prompts[r] for r in rows], [lengths[r] for r in rows], n, overhead, hidden,
                           inputs, starts[rows[0]], paths[rows[0]])
        index = torch.tensor(rows, device=dev)
        kv.place_rows(cache, index, part, len(prompts), width)
        if hidden:
            if states is None:
                states = h.new_zeros((len(prompts), width, h.shape[-1]))
            states[index, width - n :] = h
        part.release()
    return cache, states


def _few(salt: str | None) -> str:
    """The salt of a row's block keys on the few-row path: its blocks apart from the whole prefill's."""
    return (salt or "") + "\x00rows"


def _salt(runner, whole: bool, salt: str | None) -> str | None:
    """The salt of a row's block keys (``whole``: ``Runner.whole`` of its length): where the model has both paths, a
    block is kept under its path too, so only a prompt computed the same way starts from it."""
    return salt if whole or not runner.whole(PREFILL_MAX_TOKENS) else _few(salt)


def kept_tokens(runner, prompt: list[int], chain: list[bytes], hidden: bool) -> int:
    """How many leading tokens of ``prompt`` (its ``prompt_chain``, which the caller keeps: hashing a prompt's blocks
    costs ~1 us a block) its prefill would take from the runner's kept prefixes (whole blocks, with hidden states
    when ``hidden``; 0 where nothing is kept). A query."""
    n, store = len(prompt) - 1, getattr(runner, "prefixes", None)
    if store is None or n < 2:
        return 0
    return min(store.held(chain, hidden), (n - 1) // BLOCK) * BLOCK


def prompt_chain(runner, prompt: list[int], salt: str | None) -> list[bytes]:
    """The block keys ``kept_tokens`` looks ``prompt`` up by (all of its tokens but the last)."""
    n = len(prompt) - 1
    return block_keys(prompt[:n], _salt(runner, runner.whole(n), salt))


def _keep(store, cache, states, cached, chains, width) -> None:
    """Every row's whole blocks into ``store`` (those not cached yet, with hidden states where ``states`` has them)."""
    for r, (tokens, chain) in enumerate(zip(cached, chains)):
        first = store.held(chain, states is not None)
        if first == len(chain):
            store.touch(chain)
            continue
        a, b = width - len(tokens) + first * BLOCK, width - len(tokens) + min(len(chain) * BLOCK, len(tokens))
        keys = torch.stack([layer.keys[r, :, a:b] for layer in cache.layers])
        values = torch.stack([layer.values[r, :, a:b] for layer in cache.layers])
        store.put(chain, first, keys, values, states[r, a:b] if states is not None else None)


def prefill(runner, prompts: list[list[int]], name: str = "target", overhead: int | None = None,
            hidden: bool | str = False, embeds=None, salts: list | None = None, fresh: bool = False):
    """Cache every prompt but its last token as one left-padded ``SlotState``; with ``hidden``, returns
    ``(state, states)``, ``states`` ``[B, W, H]`` the model's final hidden states at those tokens, laid out like the
    state's slots (zeros on padding); ``hidden=FEATURES``: what a feature-reading head starts from (the whole prefill
    gives the last layer's input there, ``model/prefill.py``; the other paths the final states).

    Where the runner can (``Runner.prefill``: a Llama on CPU), every prompt's tokens go end to end through one forward
    (the shared prefix below once), with no padding. Elsewhere rows are grouped by ``prefill_groups`` (``overhead``
    defaults by device: ``PREFILL_OVERHEAD``): each group is one
    forward, left-padded to its longest row (padding slots hidden), and its keys and values are then copied once
    into its rows of the final rectangle. When every prompt starts with the same
    ``SHARED_PREFIX_MIN`` or more tokens (a chat template's) and sharing saves more than a forward's overhead, that
    prefix is computed once and the groups are formed and run over the tokens after it (``_prefix``,
    ``_prefill_group``). ``embeds(rows, n)``: a group's input vectors ``[len(rows), n, H]`` (its rows' last n,
    right-aligned) in place of the token embeddings (a head that reads the target's features); the end-to-end forward
    asks for each row's own n, rows of one length together (no prefix is shared then).

    The runner's prefix cache (``Runner.prefixes``, not with ``embeds``): each row starts from its own longest run of
    cached blocks (``salts``: each row's isolation salt, None: none); rows with different starts are prefilled in
    groups, one per start, and copied into one rectangle (``_by_start``); afterwards every row's blocks are cached.
    ``fresh``: the prefix cache is neither read nor written, so every position is computed (``prompt_scores``).
    """
    runner = runner if isinstance(runner, Runner) else Runner(runner)  # a model: a runner of its own
    dev = runner.device
    lengths = [len(p) - 1 for p in prompts]
    width = max(lengths, default=0)
    if overhead is None:
        overhead = PREFILL_OVERHEAD.get(dev.type, 1)
    store = runner.prefixes if embeds is None and prompts and not fresh else None
    starts, sent_again = [None] * len(prompts), False
    paths = [runner.whole(n) for n in lengths]  # each row's arithmetic, from its own length alone
    if any(lengths):  # a one-token prompt caches nothing: it goes with the others
        first = paths[next(r for r, n in enumerate(lengths) if n)]
        paths = [w if n else first for w, n in zip(paths, lengths)]
    if store is not None:
        cached = [p[:n] for p, n in zip(prompts, lengths)]
        chains = [block_keys(c, _salt(runner, whole, s), tail=True)
                  for c, s, whole in zip(cached, salts or [None] * len(prompts), paths)]
        # prompts sent again: each found whole, tail included (one-token prompts have nothing kept)
        again = [store.find(c, chain, hidden, whole=True) for c, chain in zip(cached, chains)] if all(lengths) else []
        sent_again = bool(again) and all(s is not None for s in again) and _fits(runner, again[0])
        if sent_again:
            starts = again
        else:
            starts = _starts(store, runner, cached, chains, hidden)
    groups = {}  # rows by path and cached start
    for r, s in enumerate(starts):
        groups.setdefault((paths[r], None if s is None else s.chain[-1]), []).append(r)
    if sent_again:
        cache, states = _copied(runner, starts, width, hidden)  # every prompt sent before: nothing to compute
    elif len(groups) > 1:
        cache, states = _by_group(runner, prompts, lengths, width, overhead, hidden, embeds, starts, paths,
                                  list(groups.values()))
    else:
        cache, states = _prefill(runner, prompts, lengths, width, overhead, hidden, embeds, starts[0],
                                 paths[0] if prompts else False)
    if store is not None:
        for s in {id(s): s for s in starts if s is not None}.values():
            store.used(s, sum(t is s for t in starts))
        _keep(store, cache, states if hidden else None, cached, chains, width)
    n = torch.tensor(lengths, device=dev, dtype=torch.long)
    col = torch.arange(width, device=dev)[None, :]
    valid = col >= (width - n[:, None])
    tokens = torch.full((len(prompts), width), -1, dtype=torch.long, device=dev)
    for r, length in enumerate(lengths):  # once per request at prefill, not per round
        if length:
            tokens[r, width - length :] = torch.tensor(prompts[r][:-1], device=dev)
    positions = (col - (width - n[:, None])).clamp(min=0)
    state = SlotState(runner, cache, valid, tokens, positions, name)
    if not hidden:
        return state
    if states is None:  # every prompt is one token long
        size = runner.model.config.get_text_config().hidden_size
        states = torch.zeros((len(prompts), width, size), dtype=runner.model.dtype, device=dev)
    return state, states


SCORED_POSITIONS = 1024  # prompt positions whose logits ``prompt_scores`` computes at once (bounds an [n, V] block)


def prompt_scores(runner, prompts: list[list[int]], states: torch.Tensor, k: int):
    """The target's log-softmax at each prompt token after the first, given the tokens before it, from the final
    hidden states ``prefill(..., hidden=True)`` returned for ``prompts`` (``[B, W, H]``, right-aligned): ``(chosen,
    rank, top_ids, top_values)`` over every row's tokens 1.. end to end, ``[N]``, ``[N]``, ``[N, k]``, ``[N, k]``
    (``rank``: 1 + the tokens more likely). Computed on the device, a block of positions at a time."""
    width, parts = states.shape[1], []
    for r, p in enumerate(prompts):
        n = len(p) - 1
        targets = torch.tensor(p[1:], device=states.device)
        for a in range(0, n, SCORED_POSITIONS):
            x = runner.logits(states[r, width - n + a : width - n + a + SCORED_POSITIONS])
            lsm = (x.float() if x.dtype in (torch.float16, torch.bfloat16) else x).log_softmax(-1)
            chosen = lsm.gather(-1, targets[a : a + SCORED_POSITIONS, None])
            top = lsm.topk(min(k, lsm.shape[-1]), -1)
            parts.append((chosen[:, 0], (lsm > chosen).sum(-1) + 1, top.indices, top.values))
    return tuple(torch.cat(t) for t in zip(*parts))
