"""Kept prefixes (``model/prefixes.py``): a prompt start that recurs (a system prompt, a conversation's earlier turns)
is computed once and kept; a later prefill whose prompts all start with it copies its keys, values and hidden
states and computes only the tokens after it. The state such a prefill leaves is the fresh prefill's (same slots,
tokens and positions; keys, values and hidden states equal to float64 rounding), in the grouped prefill and the
whole one, and generation from it is HF ``generate`` at batch size 1, with every drafter, through the engine and
the server."""

import httpx
import pytest
import servekit
import tiny
import torch

import batchspec
from batchspec.batch import prefilling as batch
from batchspec.model import prefill as whole
from batchspec.model.prefixes import MIN_TOKENS, Prefix, PrefixCache
from batchspec.model.runner import Runner

SYSTEM = tiny.prompts(1, seed=41, lo=20, hi=21)[0]  # 20 tokens, above MIN_TOKENS
# each starts with its own token (so the common start of any two is SYSTEM exactly), 5..29 more tokens
TAILS = [[60 + i] + t for i, t in enumerate(tiny.prompts(8, seed=42, lo=4, hi=29))]


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


@pytest.mark.parametrize("hidden", [True, False], ids=["hidden", "no-hidden"])
def test_a_recurring_start_is_kept_and_later_prefills_start_from_it(computed, hidden):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    kept = runner.prefixes
    first = [SYSTEM + TAILS[0]]
    _same(batch.prefill(runner, first, hidden=hidden, overhead=0), _fresh(t, first, hidden), hidden)
    assert len(kept) == 0  # seen once: nothing recurs yet
    second = [SYSTEM + TAILS[1]]
    _same(batch.prefill(runner, second, hidden=hidden, overhead=0), _fresh(t, second, hidden), hidden)
    assert [len(e) for e in kept._entries.values()] == [len(SYSTEM)]  # its start recurred: kept
    assert kept.hits == 0
    computed.clear()
    third = [SYSTEM + TAILS[3][:12], SYSTEM + TAILS[7][:12]]  # equal lengths: no padding in the grouped prefill
    got = batch.prefill(runner, third, hidden=hidden, overhead=0)
    assert sum(computed) == 2 * 11  # each row's own cached tokens only: the system prompt was not computed again
    assert kept.hits == 2 and kept.reused == 2 * len(SYSTEM)
    _same(got, _fresh(t, third, hidden), hidden)


def test_a_kept_prefix_is_what_the_next_prefill_reads(computed):
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    for tail in TAILS[:2]:
        batch.prefill(runner, [SYSTEM + tail], hidden=True, overhead=0)
    (entry,) = runner.prefixes._entries.values()
    entry.keys[1].add_(1.0)  # a kept prefix changed behind the runner's back
    entry.hidden.add_(2.0)
    state, states = batch.prefill(runner, [SYSTEM + TAILS[2]], hidden=True, overhead=0)
    (fresh, fresh_states) = _fresh(t, [SYSTEM + TAILS[2]], True)
    at = state.valid.shape[1] - (len(SYSTEM) + len(TAILS[2]) - 1)
    slots = slice(at, at + len(SYSTEM))
    torch.testing.assert_close(state.cache.layers[1].keys[:, :, slots], fresh.cache.layers[1].keys[:, :, slots] + 1.0,
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(states[:, slots], fresh_states[:, slots] + 2.0, rtol=0, atol=1e-12)


def test_a_longer_recurring_start_is_computed_on_top_of_the_kept_one(computed):
    """A conversation: each turn's prompt is the last one's plus an answer and a question. A turn's prompt recurs in
    the next one: that turn computes it on top of the longest kept start and keeps it, so each turn computes the
    last turn's new tokens and its own, never the system prompt or the turns before."""
    t = tiny.target()
    runner = Runner(t, prefix_cache=8)
    kept = runner.prefixes
    for tail in TAILS[:2]:
        batch.prefill(runner, [SYSTEM + tail], hidden=True, overhead=0)
    turn1 = SYSTEM + TAILS[4] + [3] * MIN_TOKENS
    turn2 = turn1 + TAILS[5] + [4] * MIN_TOKENS
    turn3 = turn2 + TAILS[6]
    starts = {}
    for turn, start in ((turn1, len(SYSTEM)), (turn2, len(SYSTEM)), (turn3, len(turn1) - 1)):
        computed.clear()
        got = batch.prefill(runner, [turn], hidden=True, overhead=0)
        assert sum(computed) == len(turn) - 1 - start  # every cached token after the longest kept start
        _same(got, _fresh(t, [turn], True), True)
        starts[len(turn)] = sorted(len(e) for e in kept._entries.values())
    assert starts == {len(turn1): [len(SYSTEM)], len(turn2): [len(SYSTEM), len(turn1) - 1],
                      len(turn3): [len(SYSTEM), len(turn1) - 1, len(turn2) - 1]}
    assert kept.hits == 3


def test_the_budget_keeps_the_most_recently_used():
    def entry(n, hidden=True):
        k = torch.zeros(1, 2, n, 4)  # 32 n bytes a tensor
        return Prefix(tuple(range(n)), [k], [k.clone()], torch.zeros(1, n, 4) if hidden else None)

    kept = PrefixCache(budget=96 * 40)
    a, b = entry(17), entry(18)
    kept.store(a)
    kept.store(b)
    prompts = [list(range(30))]
    assert kept.find(prompts, hidden=True) is b  # the longest that every prompt goes past
    assert kept.find([list(range(18))], hidden=True) is a  # 18 tokens do not go past b's
    kept.used(a, 1)
    kept.store(entry(19))  # over the budget: b, the least recently used, goes
    assert sorted(len(e) for e in kept._entries.values()) == [17, 19] and kept.nbytes <= kept.budget
    kept.store(entry(200))  # larger than the whole budget: not kept
    assert len(kept) == 2
    kept.store(entry(25, hidden=False))
    assert len(kept.find(prompts, hidden=False)) == 25 and len(kept.find(prompts, hidden=True)) == 19


def test_what_recurs():
    kept = PrefixCache(budget=1 << 20)
    a = SYSTEM + TAILS[0]
    assert kept.recurring([a]) == 0  # nothing seen
    assert kept.recurring([a, SYSTEM + TAILS[1]]) == len(SYSTEM)  # shared by the prompts of one prefill
    assert kept.recurring([a, SYSTEM[:MIN_TOKENS - 1] + TAILS[1]]) == 0  # too short to keep
    kept.remember([a])
    assert kept.recurring([SYSTEM + TAILS[1]]) == len(SYSTEM)
    assert kept.recurring([a]) == len(a) - 1  # the same prompt again: all but a token of its own
    assert kept.recurring([SYSTEM]) == len(SYSTEM) - 1


@pytest.mark.parametrize("drafter,graphs", [("none", "auto"), ("model", "auto"), ("eagle", "auto"),
                                            ("none", "static"), ("eagle", "static")])
def test_generation_from_kept_prefixes_is_the_oracles(drafter, graphs):
    """``graphs="static"``: the static-shape steps a GPU replays as graphs (run on CPU here), whose prefill is the
    grouped one."""
    t = tiny.target()
    draft = {"model": tiny.draft(), "eagle": tiny.eagle(graphs=graphs), "none": None}[drafter]
    prompts = [SYSTEM + tail for tail in TAILS]
    # two rows at a time, continuous batching: most prompts join alone, as in a server
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, batch_size=2, scheduler="continuous",
                         check_invariants=True, graphs=graphs)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 10) for p in prompts]
    assert llm.stats.prefix_hits >= 4 and llm.stats.prefix_tokens == llm.stats.prefix_hits * len(SYSTEM)
    if draft is not None:
        assert llm.stats.accepted > 0
    off = tiny.fixed_llm(t, draft=None, batch_size=2, scheduler="continuous", prefix_cache=0)
    assert [o.token_ids for o in off.generate(prompts, batchspec.SamplingParams(max_tokens=10))] == [
        o.token_ids for o in outs]
    assert off.parts.target.prefixes is None and off.stats.prefix_hits == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(ValueError, match="prefix_cache"):
        batchspec.LLM(tiny.target(), prefix_cache=bad)


def test_the_server_counts_its_kept_prefixes():
    t = tiny.target()
    with servekit.served(servekit.llm(batch_size=2)) as s:
        client = servekit.client(s.url)
        for tail in TAILS[:4]:
            r = client.completions.create(model="tiny", prompt=SYSTEM + tail, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert r.choices[0].model_extra["token_ids"] == tiny.oracle(t, SYSTEM + tail, 6)
        text = httpx.get(s.url + "/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["batchspec_prefix_cache_hits_total"] == 2  # the third and fourth request
    assert values["batchspec_prefix_cache_tokens_total"] == 2 * len(SYSTEM)


def test_kept_prefixes_follow_the_weights_they_were_computed_with():
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
    assert len(kept) == 1
    with torch.no_grad():
        t.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    llm.clear_prefixes()
    assert len(kept) == 0
    assert [o.token_ids for o in llm.generate(prompts, sp)] == oracle()
    assert len(kept) == 1 and llm.stats.prefix_hits > 0
    t.to(torch.float32)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == oracle()
    assert len(kept) == 1 and all(e.keys[0].dtype == torch.float32 for e in kept._entries.values())
