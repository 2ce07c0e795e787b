"""Hand-built cases for the round's pieces: greedy acceptance, the emitted block, cutting at stop tokens and limits,
slot buffers (append in place, hide, compact), and the running batch's row operations."""

import tiny
import torch

from batchspec.batch import Batch, Sequences, SlotState, compact_index, prefill
from batchspec.engine.engine import Request
from batchspec.engine.verify import emitted_block, greedy_accept
from batchspec.model.runner import Runner

T = torch.tensor


def test_greedy_accept_longest_matching_prefix_and_bonus():
    drafts = T([[5, 6, 7], [5, 9, 7], [1, 2, 3], [5, 6, 7]])
    n_drafts = T([3, 3, 3, 2])
    # the target's argmax after the pending token and after each draft
    target = T([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 8], [5, 6, 7, 8]])
    accepted, bonus = greedy_accept(target, drafts, n_drafts)
    assert accepted.tolist() == [3, 1, 0, 2]  # all / first / none / capped by n_drafts
    assert bonus.tolist() == [8, 6, 4, 7]  # after the last draft / at the first mismatch / ... / after the 2 usable


def test_greedy_accept_with_no_drafts_is_a_decode_step():
    accepted, bonus = greedy_accept(T([[9], [3]]), torch.empty((2, 0), dtype=torch.long), T([0, 0]))
    assert accepted.tolist() == [0, 0] and bonus.tolist() == [9, 3]


def test_emitted_block_puts_the_bonus_after_the_accepted_drafts():
    block = emitted_block(T([[5, 6, 7], [5, 9, 7]]), T([3, 1]), T([8, 6]))
    assert block[0].tolist() == [5, 6, 7, 8]
    assert block[1, :2].tolist() == [5, 6]


def _seqs(prompts, max_tokens, stops):
    reqs = [Request(p, m, set(s), id=i) for i, (p, m, s) in enumerate(zip(prompts, max_tokens, stops))]
    return Sequences(reqs, 3, torch.device("cpu"))


def test_extend_cuts_at_stop_tokens_and_limits():
    seqs = _seqs([[1, 2], [1], [3, 3, 3]], [10, 2, 10], [{7}, set(), {9}])
    block = T([[5, 7, 6, 4], [5, 6, 4, 4], [9, 1, 1, 1]])
    finished, n, cut = seqs.extend(block, T([4, 3, 1]))
    assert n.tolist() == [2, 2, 1]  # through the stop token / at max_tokens / a stop as the only token
    assert cut.tolist() == [2, 0, 0]  # verified tokens dropped after the stop token
    assert finished.tolist() == [True, True, True]
    assert seqs.stopped.tolist() == [True, False, True]
    assert seqs.history[0, :4].tolist() == [1, 2, 5, 7] and seqs.length.tolist() == [4, 3, 4]


def test_slot_buffers_append_in_place_and_compact_in_place():
    t = tiny.target()
    st = prefill(Runner(t), [[5, 6, 7, 8], [9, 10]])
    buf, cap = st._buf["valid"], st.capacity
    keys = st.cache.layers[0]._k
    st.append(T([[1, 2], [3, 4]]))
    st.hide_tail(2, T([1, 2]))  # row 0 rejects its second new slot
    assert st._buf["valid"] is buf and st.capacity == cap  # written in place, no regrowth
    assert st.valid.tolist() == [[True, True, True, True, False], [False, False, True, True, True]]
    assert st.positions[1].tolist()[2:] == [0, 1, 2] and st.positions[0].tolist() == [0, 1, 2, 3, 4]
    index, pad = compact_index(st.valid, 4)
    st.gather(index, pad)
    assert st._buf["valid"] is buf and st.cache.layers[0]._k is keys  # compacted in place
    assert st.width == 4 and st.tokens.tolist() == [[5, 6, 7, 1], [-1, 9, 3, 4]]


def test_batch_row_operations_move_every_part_together():
    t, d = tiny.target(), tiny.draft()
    from batchspec.drafters import ModelDrafter

    drafter = ModelDrafter(d)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    def make(ps, first_id):
        reqs = [Request(p, 4, set(), id=first_id + i) for i, p in enumerate(ps)]
        return Batch(Sequences(reqs, 3, torch.device("cpu")), prefill(Runner(t), ps), drafter.prefill(ps),
                     [len(p) for p in ps])

    batch = make(prompts[:2], 0).merge(make(prompts[2:], 2))
    assert batch.request_ids == [0, 1, 2] and batch.lengths == [3, 2, 4]
    assert len(batch.target) == len(batch.draft.slots) == len(batch.seqs) == 3
    part = batch.take([2, 0])
    assert part.request_ids == [2, 0] and part.lengths == [4, 3]
    assert part.target.tokens[0, -3:].tolist() == [10, 11, 12]
    batch.select_rows([2, 1])
    assert batch.request_ids == [2, 1] and batch.lengths == [4, 2]
    assert batch.draft.slots.tokens[1, -1].item() == 8 and batch.target.tokens[0, -1].item() == 12
    assert isinstance(batch.target, SlotState)
