"""Logits processors under speculation: each one's greedy output equals Hugging Face ``generate`` at batch size 1 with
the equivalent processor, at batch 1 and 8, without a drafter, with prompt lookup and with a draft model (drafts
accepted, invariants checked, and the processor changes the output); seeded sampling stays reproducible; ``min_p``
keeps only the tokens it should; stop strings cut the output offline as the server does; the server takes the
processors' fields."""

from __future__ import annotations

import functools

import httpx
import pytest
import torch
import tiny
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from batchspec import SamplingParams

PROMPTS = tiny.prompts(8, seed=3)
N = 16
DRAFTERS = {"plain": None, "lookup": "prompt-lookup", "draft": "draft"}


class OpenAIPenalties(LogitsProcessor):
    """The oracle for ``presence_penalty`` / ``frequency_penalty``: OpenAI's definition over the generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def _hf(prompt, max_tokens, processors=(), stop=()):
    model = tiny.target()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                         logits_processor=LogitsProcessorList(processors), eos_token_id=list(stop) or None,
                         pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@functools.lru_cache(maxsize=None)
def _plain() -> list[list[int]]:
    return [tiny.oracle(tiny.target(), p, N) for p in PROMPTS]


def _case(name: str):
    """``(SamplingParams fields, HF processors for a prompt)`` of one processor; words and stop ids are taken from
    the plain outputs, so each one has something to change."""
    plain = _plain()
    if name == "repetition":
        return dict(repetition_penalty=1.3), lambda p: [RepetitionPenaltyLogitsProcessor(1.3)]
    if name == "penalties":
        return (dict(presence_penalty=-0.5, frequency_penalty=0.2),  # negative: repeats, so lookup finds drafts
                lambda p: [OpenAIPenalties(len(p), -0.5, 0.2)])
    if name == "bias":
        bias = {plain[0][3]: -4.0, 17: 2.5}
        return dict(logit_bias=bias), lambda p: [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])]
    if name == "bad_words":
        words = [plain[1][2:4], [plain[2][1]], plain[5][4:7]]
        return dict(bad_words=words), lambda p: [NoBadWordsLogitsProcessor(words)]
    if name == "min_tokens":
        stop = plain[4][2]
        return (dict(min_tokens=6, stop_token_ids=[stop], ignore_eos=True),
                lambda p: [MinNewTokensLengthLogitsProcessor(len(p), 6, [stop])])
    raise ValueError(name)


def _llm(drafter: str, batch_size: int, **kw):
    draft = tiny.draft() if drafter == "draft" else DRAFTERS[drafter]
    return tiny.fixed_llm(tiny.target(), draft=draft, num_draft_tokens=4, batch_size=batch_size,
                          check_invariants=True, weights="fp32", prefix_cache=0, **kw)


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("name", ["repetition", "penalties", "bias", "bad_words", "min_tokens"])
def test_greedy_with_a_processor_equals_hf_at_batch_1(name, drafter, batch_size):
    fields, hf = _case(name)
    stop = fields.get("stop_token_ids", ())
    want = [_hf(p, N, hf(p), stop) for p in PROMPTS]
    without = [_hf(p, N, (), stop) for p in PROMPTS]
    assert want != without  # the processor changes what is generated
    outs = _llm(drafter, batch_size).generate(PROMPTS, SamplingParams(max_tokens=N, **fields))
    assert [o.token_ids for o in outs] == want
    if drafter != "plain":
        assert sum(o.num_accepted for o in outs) > 0  # speculation ran: drafts were verified and accepted


def test_processors_together_and_rows_without_them_in_one_batch():
    """Rows with every processor beside rows with none, joining a running batch (continuous scheduling): each row's
    output is its own batch-1 output."""
    cases = ["repetition", "penalties", "bias", "bad_words"]
    fields = [dict(_case(c)[0]) for c in cases]
    together = {k: v for f in fields for k, v in f.items()}
    params = [SamplingParams(max_tokens=N, **(together if i % 3 == 0 else fields[i % 4] if i % 3 == 1 else {}))
              for i in range(len(PROMPTS))]
    want = []
    for i, p in enumerate(PROMPTS):
        if i % 3 == 0:
            order = ["bias", "bad_words", "repetition", "penalties"]  # the engine's order
            want.append(_hf(p, N, [x for c in order for x in _case(c)[1](p)]))
        elif i % 3 == 1:
            want.append(_hf(p, N, _case(cases[i % 4])[1](p)))
        else:
            want.append(_plain()[i])
    llm = _llm("draft", 3, scheduler="continuous")
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert llm.stats.joined_running > 0 and llm.stats.accepted > 0


def test_seeded_sampling_with_penalties_is_reproducible_whatever_the_batch():
    fields = dict(temperature=0.9, seed=11, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                  logit_bias={9: 1.5}, max_tokens=N)
    params = [SamplingParams(**{**fields, "seed": 11 + i}) for i in range(len(PROMPTS))]
    alone = [_llm("draft", 1).generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    batched = _llm("draft", 8).generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == alone
    assert sum(o.num_accepted for o in batched) > 0
    free = _llm("draft", 8).generate(PROMPTS, [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=N)
                                               for i in range(len(PROMPTS))])
    assert [o.token_ids for o in free] != alone


def test_min_p_keeps_only_tokens_near_the_most_likely():
    """Every sampled token has at least ``min_p`` times the top probability of the target's distribution there (at
    the request's temperature); without ``min_p`` the same seeds draw tokens below it."""

    def below(outs):
        low = 0
        for p, o in zip(PROMPTS, outs):
            ids = torch.tensor([p + o.token_ids])
            with torch.no_grad():
                probs = (tiny.target()(ids).logits[0, len(p) - 1 : -1] / 2.0).softmax(-1)
            chosen = probs.gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
            low += int((chosen < 0.2 * probs.max(-1).values).sum())
        return low

    params = [SamplingParams(temperature=2.0, seed=i, max_tokens=N, min_p=0.2) for i in range(len(PROMPTS))]
    llm = _llm("draft", 8)
    assert below(llm.generate(PROMPTS, params)) == 0 and llm.stats.accepted > 0
    free = [SamplingParams(temperature=2.0, seed=i, max_tokens=N) for i in range(len(PROMPTS))]
    assert below(_llm("draft", 8).generate(PROMPTS, free)) > 0


def test_stop_strings_cut_the_output_as_the_server_does():
    tok = tiny.tokenizer()
    llm = _llm("lookup", 8, tokenizer=tok)
    full = llm.generate(PROMPTS, SamplingParams(max_tokens=N))
    stop = tok.decode(full[1].token_ids[5:7])  # two tokens in the middle of one output
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N, stop=[stop]))
    for f, o in zip(full, outs):
        if stop in f.text:
            cut = f.text.index(stop)
            assert o.finish_reason == "stop" and o.text == f.text[:cut]
            assert o.token_ids == f.token_ids[: len(o.token_ids)] and len(o.token_ids) < len(f.token_ids)
        else:
            assert (o.token_ids, o.text, o.finish_reason) == (f.token_ids, f.text, f.finish_reason)
    assert outs[1].token_ids == full[1].token_ids[:7]


def test_the_server_takes_the_processors_and_gives_the_offline_tokens():
    import servekit
    from batchspec.serve.app import create_app
    from batchspec.serve.server import ServerThread

    body = dict(presence_penalty=0.8, frequency_penalty=0.4, logit_bias={"17": 2.5}, repetition_penalty=1.3,
                min_p=0.1, min_tokens=2)
    offline = servekit.llm().generate([PROMPTS[1]], SamplingParams(max_tokens=N, **{
        **body, "logit_bias": {17: 2.5}}))[0].token_ids
    assert offline != _plain()[1]
    with ServerThread(create_app(servekit.llm(), model_name="tiny")) as s:
        r = httpx.post(f"{s.url}/v1/completions", json=dict(model="tiny", prompt=PROMPTS[1], max_tokens=N,
                                                             temperature=0, return_token_ids=True, **body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == offline


def test_speculative_sampling_with_penalties_has_the_processed_distribution():
    """The distributional audit's comparison for a repetition and a presence penalty: 2000 seeded samples of two
    tokens through a draft model against the exact distribution of the processed target (and not the raw one)."""
    from test_sampling_audit import ALPHA, VOCAB, small_draft, small_target

    from batchspec.audit.distribution import Reference, compare

    model, prompt = small_target(), [12, 8, 7, 15, 12, 8]

    def dist(generated, penalised):
        with torch.no_grad():
            x = model(torch.tensor([prompt + generated])).logits[0, -1]
        if penalised:
            seen = torch.zeros(VOCAB, dtype=torch.bool)
            seen[prompt + generated] = True
            x = torch.where(seen, torch.where(x < 0, x * 1.5, x / 1.5), x)
            x = x - 0.5 * (torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=VOCAB) > 0)
        return x.softmax(-1).tolist()

    def reference(penalised):
        first = dist([], penalised)
        cells = [{(a,): first[a] for a in range(VOCAB)}, {}]
        for a in range(VOCAB):
            cells[1].update({(a, b): first[a] * p for b, p in enumerate(dist([a], penalised))})
        return Reference(prompt, 2, cells, {k: None for k in [(), *((a,) for a in range(VOCAB))]})  # all positive

    llm = tiny.fixed_llm(model, draft=small_draft(), num_draft_tokens=3, batch_size=64, weights="fp32",
                         prefix_cache=0)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=2, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5) for i in range(2000)]
    outs = [o.token_ids for o in llm.generate([prompt] * 2000, params)]
    assert llm.stats.accepted > 0
    right = compare(reference(True), outs, 2)
    assert right.impossible == 0 and right.p_value > ALPHA, right
    assert compare(reference(False), outs, 2).p_value < 1e-10


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_model_drafts_from_the_processed_distribution(temperature):
    """A bias the draft model did not see would reject nearly every draft (about 2% accepted); processed as the
    target's logits are, its drafts stay likely."""
    llm = _llm("draft", 8)
    params = [SamplingParams(max_tokens=N, temperature=temperature, seed=i, logit_bias={17: 2.5},
                             repetition_penalty=1.2) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    assert llm.stats.accepted > 0.4 * llm.stats.drafted
    if temperature == 0:
        hf = [SequenceBiasLogitsProcessor([[[17], 2.5]]), RepetitionPenaltyLogitsProcessor(1.2)]
        assert [o.token_ids for o in outs] == [_hf(p, N, hf) for p in PROMPTS]
