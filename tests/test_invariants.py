"""The invariant checker: silent on correct runs, and it names the right invariant when a state is corrupted."""

import pytest
import tiny
import torch

import batchspec
from batchspec.batch import InvariantError, check_invariants, compact_index, prefill


def _state(prompts):
    state = prefill(tiny.target("llama"), prompts)
    hist = torch.full((len(prompts), 64), -1)
    for i, p in enumerate(prompts):
        hist[i, : len(p)] = torch.tensor(p)
    processed = torch.tensor([len(p) - 1 for p in prompts])
    return state, hist, processed


PROMPTS = [[5, 6, 7, 8, 9], [3], [4, 4, 2]]


def test_clean_state_passes():
    state, hist, processed = _state(PROMPTS)
    assert state.width == 4 and state.valid.sum().item() == 4 + 0 + 2
    check_invariants(state, hist, processed, 0)


@pytest.mark.parametrize("corrupt,kind,row", [
    (lambda s: s.valid.__setitem__((2, 0), True), "padding", 2),
    (lambda s: s.valid.__setitem__((0, 1), False), "count", 0),
    (lambda s: s.tokens.__setitem__((2, 3), 11), "content", 2),
    (lambda s: s.positions.__setitem__((0, 2), 7), "positions", 0),
])
def test_corruption_is_named(corrupt, kind, row):
    state, hist, processed = _state(PROMPTS)
    corrupt(state)
    with pytest.raises(InvariantError) as e:
        check_invariants(state, hist, processed, 4)
    assert (e.value.invariant, e.value.kind, e.value.row, e.value.round, e.value.cache) == ("I2", kind, row, 4, "target")


def test_shape_mismatch_is_i1():
    state, hist, processed = _state(PROMPTS)
    layer = state.cache.layers[1]
    layer.set(layer.keys[:, :, 1:], layer.values[:, :, 1:])
    with pytest.raises(InvariantError) as e:
        check_invariants(state, hist, processed, 1)
    assert (e.value.invariant, e.value.kind) == ("I1", "shape")


def test_pending_token_cached_is_count():
    state, hist, processed = _state(PROMPTS)
    with pytest.raises(InvariantError, match="count"):
        check_invariants(state, hist, processed - 1, 0)


def test_compact_index_right_aligns_valid_slots():
    valid = torch.tensor([[0, 1, 0, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    index, pad = compact_index(valid, 3)
    assert index[0].tolist() == [1, 3, 4] and not pad[0].any()
    assert index[1].tolist() == [0, 1, 2] and not pad[1].any()
    assert pad[2].all()


def test_engine_raises_on_fault_with_checker():
    """With check_invariants=True a corrupting engine stops at the first violated invariant."""
    llm = tiny.fixed_llm(tiny.target("llama"), draft=tiny.draft("llama"), num_draft_tokens=3, batch_size=4,
                        layout="eqspec", check_invariants=True, fault="bsp-keep-rejected-kv")
    with pytest.raises(InvariantError) as e:
        llm.generate(tiny.prompts(4), batchspec.SamplingParams(max_tokens=12))
    assert e.value.invariant == "I2" and e.value.cache == "target"


def test_draft_cache_is_checked():
    """The draft model's cache is checked too: corrupting it after a round is reported for the draft."""
    llm = tiny.fixed_llm(tiny.target("llama"), draft=tiny.draft("llama"), num_draft_tokens=3, batch_size=4,
                        check_invariants=True)
    drafter = llm.drafter
    original = drafter.commit

    def bad_commit(state, proposal, accepted, target):
        original(state, proposal, accepted, target)
        state.slots.valid[:, -1] = True  # reveal the last (possibly rejected) draft slot

    drafter.commit = bad_commit
    with pytest.raises(InvariantError) as e:
        llm.generate(tiny.prompts(6), batchspec.SamplingParams(max_tokens=20))
    assert e.value.cache == "draft"
