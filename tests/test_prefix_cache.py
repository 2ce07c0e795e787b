"""Automatic prefix caching (``model/prefixes.py``): every prompt prefilled is cached in hashed blocks; a later prompt
starts from its longest cached start (whenever it was seen; rows of one prefill from different starts) and computes
only the tokens after it. The state such a prefill leaves is the fresh prefill's (same slots, tokens and positions;
keys, values and hidden states equal to float64 rounding), in the grouped prefill and the whole one, and generation
from it is HF ``generate`` at batch size 1, with every drafter, through the engine and the server."""

import httpx
import pytest
import servekit
import tiny
import torch

import batchspec
from batchspec.batch import prefilling as batch
from batchspec.model import prefill as whole
from batchspec.model.prefixes import BLOCK, PrefixCache, block_keys, default_mib
from batchspec.model.runner import Runner

SYSTEM = tiny.prompts(1, seed=41, lo=40, hi=41)[0]  # 40 tokens: two whole blocks and a part of a third
# each starts with its own token (so the common start of any two is SYSTEM exactly), 5..29 more tokens
TAILS = [[60 + i] + t for i, t in enumerate(tiny.prompts(8, seed=42, lo=4, hi=29))]
HIT = 2 * BLOCK  # the whole blocks of SYSTEM


@pytest.fixture(params=["grouped", "whole"])
def computed(request, monkeypatch):
    """The tokens each prefill computes, per forward (the grouped prefill pads its groups: equal lengths here)."""
    calls = []
    if request.param == "grouped":
        monkeypatch.setattr(whole, "supported", lambda model: False)
        real = Runner.forward

        def spy(self, cache, input_ids, *args, **kw):
            calls.append(input_ids.numel())
            return real(self, cache, input_ids, *args, **kw)

        monkeypatch.setattr(Runner, "forward", spy)
    else:
        real_forward = whole._forward

        def spy_forward(model, cache, prompts, rows, shared, width, hidden, where, x=None, base=None, kept=None):
            calls.append(shared - (len(base) if base is not None else 0) + sum(len(p) - shared for p in prompts))
            return real_forward(model, cache, prompts, rows, shared, width, hidden, where, x, base, kept)

        monkeypatch.setattr(whole, "_forward", spy_forward)
    return calls


def _same(a, b, hidden):
    (sa, ha), (sb, hb) = (a, b) if hidden else ((a, None), (b, None))
    for name in ("valid", "tokens", "positions"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    visible = sa.valid[:, None, :, None]
    for (k0, v0), (k1, v1) in zip(sa.cache.tensors(), sb.cache.tensors(), strict=True):
        assert k0.shape == k1.shape
        torch.testing.assert_close(k1 * visible, k0 * visible, rtol=0, atol=1e-12)
        torch.testing.assert_close(v1 * visible, v0 * visible, rtol=0, atol=1e-12)
    if hidden:
        torch.testing.assert_close(hb, ha, rtol=0, atol=1e-12)


def _fresh(t, prompts, hidden):
    return batch.prefill(Runner(t), prompts, hidden=hidden, overhead=0)


def _uncached(prompts, hits):
    """The tokens a prefill computes: every prompt's cached tokens (all but its last) after its hit."""
    return sum(len(p) - 1 - h for p, h in zip(prompts, hits))


@pytest.mark.parametrize("hidden", [True, False], ids=["hidden", "no-hidden"])
def test_every_prompt_is_cached_and_a_later_one_starts_from_its_longest_cached_start(computed, hidden):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    kept = runner.prefixes
    first = [SYSTEM + TAILS[0]]
    _same(batch.prefill(runner, first, hidden=hidden, overhead=0), _fresh(t, first, hidden), hidden)
    blocks = -(-(len(first[0]) - 1) // BLOCK)  # seen once: every whole block cached, and the tokens past them
    assert len(kept) == blocks and kept.hits == 0
    computed.clear()
    second = [SYSTEM + TAILS[1]]
    got = batch.prefill(runner, second, hidden=hidden, overhead=0)
    assert sum(computed) == _uncached(second, [HIT])  # the first prompt's blocks of SYSTEM were not computed again
    _same(got, _fresh(t, second, hidden), hidden)
    assert kept.hits == 1 and kept.reused == HIT
    computed.clear()
    third = [SYSTEM + TAILS[3][:12], SYSTEM + TAILS[7][:12]]  # equal lengths: no padding in the grouped prefill
    got = batch.prefill(runner, third, hidden=hidden, overhead=0)
    assert sum(computed) == _uncached(third, [HIT, HIT]) - (len(SYSTEM) - HIT)  # the rest of SYSTEM once for both
    assert kept.hits == 3 and kept.reused == 3 * HIT
    _same(got, _fresh(t, third, hidden), hidden)


def test_a_prompt_seen_again_after_many_others_starts_from_its_own_blocks(computed):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    again = tiny.prompts(1, seed=7, lo=70, hi=71)[0]
    batch.prefill(runner, [again], hidden=True, overhead=0)
    for p in tiny.prompts(40, seed=8, lo=20, hi=60):  # more than the old history of 32 prompts
        batch.prefill(runner, [p], hidden=True, overhead=0)
    computed.clear()
    got = batch.prefill(runner, [again], hidden=True, overhead=0)
    assert sum(computed) == 0 and runner.prefixes.reused == len(again) - 1  # sent again: every token kept
    _same(got, _fresh(t, [again], True), True)


@pytest.mark.parametrize("hidden", [True, False], ids=["hidden", "no-hidden"])
def test_rows_of_one_prefill_start_from_their_own_cached_starts(computed, hidden):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    other = tiny.prompts(1, seed=43, lo=24, hi=25)[0]
    batch.prefill(runner, [SYSTEM + TAILS[0], other + TAILS[1]], hidden=hidden, overhead=0)
    computed.clear()
    rows = [other + TAILS[2], tiny.prompts(1, seed=44, lo=30, hi=31)[0], SYSTEM + TAILS[3], [5], SYSTEM + TAILS[4]]
    got = batch.prefill(runner, rows, hidden=hidden, overhead=0)
    hits = [BLOCK, 0, HIT, 0, HIT]  # one block of ``other``, none, SYSTEM's two twice (a one-token prompt: none)
    assert sum(computed) == _uncached(rows, hits) - (len(SYSTEM) - HIT)  # the rest of SYSTEM once for both
    assert runner.prefixes.hits == 3 and runner.prefixes.reused == sum(hits)
    _same(got, _fresh(t, rows, hidden), hidden)


def test_salts_keep_prompts_apart():
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    kept, p = runner.prefixes, SYSTEM + TAILS[0]
    batch.prefill(runner, [p], salts=["a"])
    batch.prefill(runner, [p], salts=["b"])
    batch.prefill(runner, [p])
    assert kept.hits == 0  # each salt's blocks are its own
    batch.prefill(runner, [p, p, p], salts=["b", None, "c"])
    assert kept.hits == 2
    assert block_keys(p, "a") != block_keys(p, "b") and block_keys(p, None) == block_keys(p, "")


def test_a_block_key_covers_every_token_before_it():
    a, b = SYSTEM[:2 * BLOCK], [SYSTEM[0] + 1] + SYSTEM[1 : 2 * BLOCK]  # the same second block after other tokens
    ka, kb = block_keys(a), block_keys(b)
    assert len(ka) == 2 and ka[0] != kb[0] and ka[1] != kb[1]
    assert block_keys(a + [5] * (BLOCK - 1)) == ka  # a part of a block has no key
    assert block_keys(a[:BLOCK]) == ka[:1]


def test_a_cached_block_is_what_the_next_prefill_reads(computed):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    batch.prefill(runner, [SYSTEM + TAILS[0]], hidden=True, overhead=0)
    block = runner.prefixes._blocks[block_keys(SYSTEM)[1]]
    block.keys[1].add_(1.0)  # a cached block changed behind the runner's back
    block.hidden.add_(2.0)
    state, states = batch.prefill(runner, [SYSTEM + TAILS[2]], hidden=True, overhead=0)
    (fresh, fresh_states) = _fresh(t, [SYSTEM + TAILS[2]], True)
    at = state.valid.shape[1] - (len(SYSTEM) + len(TAILS[2]) - 1)
    slots = slice(at + BLOCK, at + HIT)
    torch.testing.assert_close(state.cache.layers[1].keys[:, :, slots], fresh.cache.layers[1].keys[:, :, slots] + 1.0,
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(states[:, slots], fresh_states[:, slots] + 2.0, rtol=0, atol=1e-12)


def test_a_conversation_computes_only_each_turns_new_tokens(computed):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    turn1 = SYSTEM + TAILS[4]
    turn2 = turn1 + TAILS[5]
    turn3 = turn2 + TAILS[6]
    for turn, last in ((turn1, None), (turn2, turn1), (turn3, turn2)):
        computed.clear()
        got = batch.prefill(runner, [turn], hidden=True, overhead=0)
        hit = 0 if last is None else (len(last) - 1) // BLOCK * BLOCK  # the last turn's whole blocks
        assert sum(computed) == _uncached([turn], [hit])
        _same(got, _fresh(t, [turn], True), True)
    assert runner.prefixes.hits == 2


def test_eviction_keeps_the_budget_and_drops_descendants_first(computed):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    long = tiny.prompts(1, seed=9, lo=90, hi=91)[0]  # five whole blocks and a part
    batch.prefill(runner, [long], overhead=0)
    block = runner.prefixes.nbytes // len(runner.prefixes)
    kept = runner.prefixes = PrefixCache(budget=3 * block + block // 2)
    chain = block_keys(long[:-1], tail=True)
    batch.prefill(runner, [long], overhead=0)
    assert [k in kept for k in chain] == [True] * 3 + [False] * 3 and kept.evictions == 3  # the part first
    assert kept.nbytes <= kept.budget
    computed.clear()
    got = batch.prefill(runner, [long], overhead=0)
    assert sum(computed) == _uncached([long], [3 * BLOCK])  # its first three blocks, still cached
    _same(got, _fresh(t, [long], False), False)
    for p in tiny.prompts(6, seed=10, lo=40, hi=60):  # others take the room, least recently used first
        batch.prefill(runner, [p], overhead=0)
        held = [k in kept for k in chain]
        assert held == sorted(held, reverse=True)  # a block is never dropped before its descendants
    assert kept.nbytes <= kept.budget and kept.evictions > 2 and not any(k in kept for k in chain)


def test_the_unit_cache_drops_least_recently_used_leaves():
    kept = PrefixCache(budget=0)
    assert kept.find(SYSTEM, block_keys(SYSTEM), hidden=False) is None
    keys = torch.zeros(1, 1, 2 * BLOCK, 1)  # 2 blocks of BLOCK x 4 bytes, keys and values
    kept.budget = 3 * 2 * BLOCK * 4  # three blocks
    a, b = block_keys(SYSTEM[: 2 * BLOCK]), block_keys(SYSTEM[:BLOCK] + [7] * BLOCK)
    kept.put(a, 0, keys, keys, None)
    kept.put(b, 1, keys[:, :, :BLOCK], keys[:, :, :BLOCK], None)  # b shares a's first block
    assert len(kept) == 3 and kept.evictions == 0
    kept.touch(a)
    kept.put(block_keys([8] * BLOCK), 0, keys[:, :, :BLOCK], keys[:, :, :BLOCK], None)
    assert b[1] not in kept and a[0] in kept and a[1] in kept and kept.evictions == 1  # b's leaf: least recently used
    assert kept.held(a, hidden=False) == 2 and kept.held(a, hidden=True) == 0


def test_the_default_budget_is_sized_from_the_machine():
    mib = default_mib(torch.device("cpu"))
    assert 1 <= mib <= 4096
    assert Runner(tiny.target(), prefix_cache=None).prefixes.budget == mib << 20
    assert batchspec.LLM(tiny.target()).parts.target.prefixes.budget == mib << 20


@pytest.mark.parametrize("drafter,graphs", [("none", "auto"), ("model", "auto"), ("eagle", "auto"),
                                            ("none", "static"), ("eagle", "static")])
def test_generation_from_cached_prefixes_is_the_oracles(drafter, graphs):
    """``graphs="static"``: the static-shape steps a GPU replays as graphs (run on CPU here), whose prefill is the
    grouped one. Two rows at a time, continuous batching (most prompts join alone, as in a server); then every
    prompt again, four at a time, each row from its own cached start."""
    t = tiny.target()
    draft = {"model": tiny.draft(), "eagle": tiny.eagle(graphs=graphs), "none": None}[drafter]
    prompts = [SYSTEM + tail for tail in TAILS]
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, batch_size=2, scheduler="continuous",
                         check_invariants=True, graphs=graphs)
    sp = batchspec.SamplingParams(max_tokens=10)
    outs = llm.generate(prompts, sp)
    oracle = [tiny.oracle(t, p, 10) for p in prompts]
    assert [o.token_ids for o in outs] == oracle
    assert llm.stats.prefix_hits == len(prompts) - 2 and llm.stats.prefix_tokens == llm.stats.prefix_hits * HIT
    if draft is not None:
        assert llm.stats.accepted > 0
    llm.batch_size, before = 4, (llm.stats.prefix_hits, llm.stats.prefix_tokens)
    again = [TAILS[0] + TAILS[1], *prompts[:4], TAILS[0] + TAILS[2]]  # TAILS[0] is no whole block of any prompt
    outs = llm.generate(again, sp)
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 10) for p in again]
    hits = [(len(p) - 2) // BLOCK * BLOCK for p in prompts[:4]]  # each of its whole blocks, or (joining alone) all
    assert llm.stats.prefix_hits - before[0] == 4
    assert sum(hits) <= llm.stats.prefix_tokens - before[1] <= sum(len(p) - 1 for p in prompts[:4])
    off = tiny.fixed_llm(t, draft=None, batch_size=2, scheduler="continuous", prefix_cache=0)
    assert [o.token_ids for o in off.generate(prompts, sp)] == oracle
    assert off.parts.target.prefixes is None and off.stats.prefix_hits == 0


def test_a_request_salt_keeps_generation_apart():
    t = tiny.target()
    llm = tiny.fixed_llm(t, batch_size=1, scheduler="continuous")
    p = SYSTEM + TAILS[0]
    for salt, hits in (("a", 0), ("b", 0), ("a", 1), (None, 1)):
        out = llm.generate([p], batchspec.SamplingParams(max_tokens=4, cache_salt=salt))
        assert out[0].token_ids == tiny.oracle(t, p, 4) and llm.stats.prefix_hits == hits
    with pytest.raises(ValueError, match="cache_salt"):
        batchspec.SamplingParams(cache_salt=3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="prefix_cache"):
        batchspec.LLM(tiny.target(), prefix_cache=bad)


def _metrics(url, key: str | None = None) -> dict:
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in r.text.splitlines()
            if line and not line.startswith("#")}


def test_the_server_counts_its_cached_prefixes_and_keeps_salts_apart():
    t = tiny.target()
    with servekit.served(servekit.llm(batch_size=2)) as s:
        client = servekit.client(s.url)
        for tail, salt in zip(TAILS[:5], [None, None, None, None, "x"]):
            r = client.completions.create(model="tiny", prompt=SYSTEM + tail, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True, "cache_salt": salt})
            assert r.choices[0].model_extra["token_ids"] == tiny.oracle(t, SYSTEM + tail, 6)
        values = _metrics(s.url)
        with pytest.raises(Exception, match="cache_salt"):
            client.completions.create(model="tiny", prompt=[5, 6], max_tokens=2, extra_body={"cache_salt": 7})
    assert values["batchspec_prefix_cache_hits_total"] == 3  # the second to fourth request; the fifth's salt differs
    assert values["batchspec_prefix_cache_tokens_total"] == 3 * HIT
    assert values["batchspec_prefix_cache_evictions_total"] == 0


def test_an_api_key_salts_its_requests():
    from batchspec.serve.app import create_app
    from batchspec.serve.server import ServerThread

    t, p = tiny.target(), SYSTEM + TAILS[0]
    llm = servekit.llm(batch_size=2)
    llm.generate([p], batchspec.SamplingParams(max_tokens=2))  # cached without a salt
    with ServerThread(create_app(llm, model_name="tiny", api_key="k1")) as s:
        client = servekit.client(s.url, key="k1")
        for hits in (0, 1):
            r = client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == tiny.oracle(t, p, 6)
            assert _metrics(s.url, key="k1")["batchspec_prefix_cache_hits_total"] == hits


def test_cached_prefixes_follow_the_weights_they_were_computed_with():
    """Weights edited in place: ``clear_prefixes`` drops what was kept; a model cast to another dtype drops it by
    itself. Outputs are HF's of the model as it is (a private copy of the tiny target: it is changed here)."""
    t = tiny._build("llama", 0, torch.float64, "sdpa")
    prompts = [SYSTEM + tail for tail in TAILS[:4]]
    llm = tiny.fixed_llm(t, batch_size=1, scheduler="continuous")
    sp = batchspec.SamplingParams(max_tokens=6)

    def oracle():
        return [tiny._generate(t, p, 6, ()) for p in prompts]

    assert [o.token_ids for o in llm.generate(prompts, sp)] == oracle()
    kept = llm.parts.target.prefixes
    assert len(kept) > 0
    with torch.no_grad():
        t.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    llm.clear_prefixes()
    assert len(kept) == 0
    assert [o.token_ids for o in llm.generate(prompts, sp)] == oracle()
    assert len(kept) > 0 and llm.stats.prefix_hits > 0
    t.to(torch.float32)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == oracle()
    assert len(kept) > 0 and all(b.keys.dtype == torch.float32 for b in kept._blocks.values())


def test_a_prompts_log_probabilities_never_depend_on_what_else_was_prefilled_or_cached():
    """fp32, the arithmetic of the C layer and of the whole prefill: a prompt's log-probabilities are bit for bit the
    same fresh and alone, after another prompt planted its first blocks, and beside other prompts in one prefill;
    a short prompt's (the few-row path's) too. Each prompt's path follows its own length: when it followed the
    prefill's tokens in all, a prompt's last tokens after a cached start went through the C layer and the same
    prompt fresh through the whole prefill."""
    from batchspec.model.runner import FEW_TOKENS

    t = tiny.target(dtype=torch.float32)
    assert Runner(t).packed_rows and whole.supported(t)  # both paths run here
    long_p, other, short = SYSTEM + TAILS[1] + TAILS[2] + TAILS[3], SYSTEM + TAILS[5], TAILS[4]
    rows = Runner(t).packed_rows  # the case that differed: fresh, the whole prefill; after the hit, the C layer
    assert len(short) - 1 <= FEW_TOKENS < len(long_p) - 1 and len(long_p) - 1 - HIT <= rows < len(long_p) - 1
    sp = batchspec.SamplingParams(max_tokens=6, logprobs=3)

    def run(first, prompts):
        llm = batchspec.LLM(t, batch_size=4, scheduler="continuous")
        if first:
            llm.generate(first, sp)
        return llm, [o.logprobs for o in llm.generate(prompts, sp)]

    alone = [run(None, [p])[1][0] for p in (long_p, short)]
    llm, after = run([other], [long_p])
    assert llm.stats.prefix_hits == 1 and llm.stats.prefix_tokens == HIT
    assert after[0] == alone[0]
    llm, together = run(None, [short, long_p, other])
    assert together[:2] == [alone[1], alone[0]]
    assert [o.token_id for o in alone[0]] == tiny.oracle(t, long_p, 6)


@pytest.mark.parametrize("hidden", [True, False], ids=["hidden", "no-hidden"])
def test_prompts_sent_again_compute_nothing(computed, hidden):
    """Every prompt's tokens past its last whole block are kept too (a tail, ``block_keys(tail=True)``): a prefill
    whose every prompt was prefilled before copies them all and computes nothing, with the bits a fresh prefill gives;
    a prompt under another salt, or beside a prompt not seen, computes its last tokens as before."""
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    prompts = [SYSTEM + TAILS[1], SYSTEM + TAILS[2][:5], TAILS[3][:9]]  # parts of 5, 2 and 8 tokens past the blocks
    assert all((len(p) - 1) % BLOCK for p in prompts)
    batch.prefill(runner, prompts, hidden=hidden, overhead=0)
    kept = runner.prefixes
    for again in (prompts, prompts[1:2], prompts[::-1]):
        computed.clear()
        reused = kept.reused
        got = batch.prefill(runner, again, hidden=hidden, overhead=0)
        assert sum(computed) == 0 and kept.reused - reused == sum(len(p) - 1 for p in again)
        _same(got, _fresh(t, again, hidden), hidden)
    computed.clear()
    got = batch.prefill(runner, prompts[:1], hidden=hidden, overhead=0, salts=["other"])
    assert sum(computed) == len(prompts[0]) - 1  # another salt: nothing of the first client's
    new = SYSTEM + TAILS[4]
    computed.clear()
    got = batch.prefill(runner, [prompts[0], new], hidden=hidden, overhead=0)
    assert sum(computed) == _uncached([prompts[0], new], [HIT + BLOCK * ((len(TAILS[1]) - 1) // BLOCK), HIT])
    _same(got, _fresh(t, [prompts[0], new], hidden), hidden)


def test_a_prompt_sent_again_has_the_log_probabilities_it_had():
    """fp32: a prompt sent again alone (every token kept, nothing computed at its prefill) gives the tokens and the
    log-probabilities, bit for bit, it gave the first time, long (the whole prefill's path) and short."""
    t = tiny.target(dtype=torch.float32)
    sp = batchspec.SamplingParams(max_tokens=6, logprobs=3)
    llm = batchspec.LLM(t, batch_size=4, scheduler="continuous")
    for p in (SYSTEM + TAILS[1] + TAILS[2] + TAILS[3], TAILS[4]):
        first = llm.generate([p], sp)[0]
        tokens = llm.stats.prefix_tokens
        again = llm.generate([p], sp)[0]
        assert llm.stats.prefix_tokens - tokens == len(p) - 1
        assert again.token_ids == first.token_ids == tiny.oracle(t, p, 6) and again.logprobs == first.logprobs


def test_the_whole_prefills_products_give_a_row_the_same_bits_however_few_rows_beside_it():
    """torch's CPU product takes other paths for a few rows (``prefill.least_rows``; oneDNN's where a check finds
    that it does, ``_onednn_least``): a prompt's last tokens after a cached start are computed as they would be among
    many, whatever their number."""
    for k, n in ((576, 576), (576, 1536), (1536, 576)):
        lin = torch.nn.Linear(k, n, bias=False).requires_grad_(False)
        x = torch.randn(64, k)
        full = whole._linear(lin, x, torch.empty(64, n), None)
        for m in range(1, whole.least_rows() + 2):
            assert torch.equal(whole._linear(lin, x[:m], torch.empty(m, n), None), full[:m]), (k, n, m)


@pytest.mark.parametrize("drafter", ["none", "model", "eagle"])
def test_long_prompts_join_a_running_batch_a_chunk_at_a_time(drafter):
    """While rows run, a prompt longer than the step's prompt-token budget is prefilled a budget's worth a step into
    the kept prefixes, each chunk from where the last one ended, and joins when what is left fits: the running rows
    stream tokens between its chunks, and every output is HF batch-1's (the head's features come from the chunks)."""
    t = tiny.target()
    draft = {"model": tiny.draft(), "eagle": tiny.eagle(), "none": None}[drafter]
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, batch_size=4, scheduler="continuous",
                         check_invariants=True, prefix_cache=8)
    short = tiny.prompts(2, seed=70, lo=5, hi=9)
    long = tiny.prompts(2, seed=71, lo=100, hi=120)
    engine = llm.engine(prefill_chunk=32)
    _, reqs = llm.requests(short + long, [batchspec.SamplingParams(max_tokens=40)] * 2 +
                           [batchspec.SamplingParams(max_tokens=8)] * 2)
    for r in reqs[:2]:
        engine.add_request(r)
    got, steps = {}, []
    while engine.has_work():
        outs = engine.step()
        if not steps:  # the short ones run: the long ones arrive
            for r in reqs[2:]:
                engine.add_request(r)
        steps.append((len(engine.waiting), {o.request_id for o in outs if o.new_token_ids}))
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    want = {r.id: tiny.oracle(t, p, r.max_tokens) for r, p in zip(reqs, short + long)}
    assert {rid: got.get(rid, []) for rid in want} == want
    # each long prompt: ~110 tokens at 32 a step, three chunks ahead and its last ones prefilled as it joins
    assert llm.stats.prefill_chunks == 6
    assert any(waiting and {reqs[0].id, reqs[1].id} <= streamed for waiting, streamed in steps), \
        "the running rows did not stream while a long prompt waited in chunks"
    assert llm.stats.prefix_hits >= 6  # every chunk after the first, and each join, started from the kept ones
    if draft is not None:
        assert llm.stats.accepted > 0


@pytest.mark.parametrize("scored", [False, True], ids=["plain", "prompt-logprobs"])
def test_a_kept_prompt_joins_ahead_of_one_that_costs_a_prefill(scored):
    """A waiting prompt kept but for its last few tokens (sent again) joins before one that came earlier and costs a
    prefill (``Engine._kept_first``), counted in ``Stats.kept_first``; one that asks for its prompt's
    log-probabilities computes every token and keeps its place. Every output is HF batch-1's."""
    from batchspec.engine.engine import KEPT_FIRST

    t = tiny.target()
    llm = tiny.fixed_llm(t, batch_size=1, scheduler="continuous", check_invariants=True)
    kept, new = tiny.prompts(2, seed=80, lo=KEPT_FIRST + 30, hi=KEPT_FIRST + 40)
    llm.generate([kept], batchspec.SamplingParams(max_tokens=4))
    llm.reset_stats()
    engine = llm.engine()
    again = batchspec.SamplingParams(max_tokens=4, prompt_logprobs=1 if scored else None)
    _, reqs = llm.requests([new, kept], [batchspec.SamplingParams(max_tokens=4), again])
    order, got = _run_all(engine, reqs)
    assert got == {reqs[0].id: tiny.oracle(t, new, 4), reqs[1].id: tiny.oracle(t, kept, 4)}
    assert order == ([reqs[0].id, reqs[1].id] if scored else [reqs[1].id, reqs[0].id])
    assert llm.stats.kept_first == (0 if scored else 1)
    assert llm.stats.prefix_hits == (0 if scored else 1)


def test_a_short_prompt_joins_ahead_of_a_long_one_and_the_rest_keep_their_order():
    """Prompts of at most ``KEPT_FIRST`` tokens to compute move ahead of those that cost more; each group keeps the
    order in which its requests came."""
    from batchspec.engine.engine import KEPT_FIRST

    t = tiny.target()
    llm = tiny.fixed_llm(t, batch_size=1, scheduler="continuous")
    longs = tiny.prompts(2, seed=81, lo=KEPT_FIRST + 30, hi=KEPT_FIRST + 40)
    shorts = tiny.prompts(2, seed=82, lo=5, hi=KEPT_FIRST)
    prompts = [longs[0], shorts[0], longs[1], shorts[1]]
    engine = llm.engine()
    _, reqs = llm.requests(prompts, [batchspec.SamplingParams(max_tokens=3)] * 4)
    order, got = _run_all(engine, reqs)
    assert order == [reqs[i].id for i in (1, 3, 0, 2)]
    assert got == {r.id: tiny.oracle(t, p, 3) for r, p in zip(reqs, prompts)}
    assert llm.stats.kept_first == 2


def test_kept_prompts_join_in_a_prefill_of_their_own():
    """With room for both, a kept prompt that waits beside one that costs a prefill joins first and alone (its first
    token does not wait for the other's prefill); the other joins at the next step."""
    from batchspec.engine.engine import KEPT_FIRST

    t = tiny.target()
    llm = tiny.fixed_llm(t, batch_size=2, scheduler="continuous", check_invariants=True)
    kept, new = tiny.prompts(2, seed=83, lo=KEPT_FIRST + 30, hi=KEPT_FIRST + 40)
    llm.generate([kept], batchspec.SamplingParams(max_tokens=4))
    engine = llm.engine()
    _, reqs = llm.requests([new, kept], [batchspec.SamplingParams(max_tokens=4)] * 2)
    for r in reqs:
        engine.add_request(r)
    first = engine.step()
    assert {o.request_id for o in first if o.new_token_ids} == {reqs[1].id}
    assert [r.id for r in engine.waiting] == [reqs[0].id]
    got = {o.request_id: list(o.new_token_ids) for o in first}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == {reqs[0].id: tiny.oracle(t, new, 4), reqs[1].id: tiny.oracle(t, kept, 4)}


def test_a_static_batch_is_not_split_for_cheap_prompts():
    """Static batching runs a batch whole: short prompts beside long ones keep their places and share it."""
    from batchspec.engine.engine import KEPT_FIRST

    t = tiny.target()
    llm = tiny.fixed_llm(t, batch_size=4)
    prompts = [p for pair in zip(tiny.prompts(2, seed=81, lo=KEPT_FIRST + 30, hi=KEPT_FIRST + 40),
                                 tiny.prompts(2, seed=82, lo=5, hi=KEPT_FIRST)) for p in pair]
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=3))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 3) for p in prompts]
    assert llm.stats.kept_first == 0 and llm.stats.rounds == 3  # one batch of four

def _run_all(engine, reqs):
    """Add ``reqs`` and step until done: the ids in the order their first tokens came, and each one's tokens."""
    for r in reqs:
        engine.add_request(r)
    order, got = [], {}
    while engine.has_work():
        for o in engine.step():
            if o.new_token_ids and o.request_id not in order:
                order.append(o.request_id)
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return order, got
