"""Bad input gives a clear error and nothing else is lost."""

import pytest
import tiny
import torch

import batchspec


@pytest.fixture(scope="module")
def llm():
    return batchspec.LLM(tiny.target("llama"), draft=tiny.draft("llama"), num_draft_tokens=3, batch_size=4)


def test_empty_prompt_list_returns_empty(llm):
    assert llm.generate([]) == []


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []])


def test_prompt_beyond_context(llm):
    with pytest.raises(ValueError, match=r"prompt 0: 250 prompt tokens \+ max_tokens 10 = 260 exceeds .* 256"):
        llm.generate([[1] * 250], batchspec.SamplingParams(max_tokens=10))


def test_token_outside_vocabulary(llm):
    with pytest.raises(ValueError, match=f"prompt 1 has token id {tiny.VOCAB} outside the vocabulary"):
        llm.generate([[1, 2], [3, tiny.VOCAB]])
    with pytest.raises(ValueError, match="token id -1"):
        llm.generate([[-1]])


def test_string_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate(["hello"])


def test_sampling_params_count_mismatch(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [batchspec.SamplingParams(), batchspec.SamplingParams()])


def test_vocab_mismatch():
    other = tiny._build("llama", 5, torch.float64, "sdpa")
    other.resize_token_embeddings(tiny.VOCAB + 8)
    with pytest.raises(ValueError, match=rf"draft vocabulary \({tiny.VOCAB + 8} tokens\) differs from the target's \({tiny.VOCAB}\)"):
        batchspec.LLM(tiny.target("llama"), draft=other)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"layout": "paged"}, "unknown layout 'paged'"),
    ({"scheduler": "fifo"}, "unknown scheduler 'fifo'"),
    ({"fault": "nope"}, "unknown fault 'nope'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        batchspec.LLM(tiny.target("llama"), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature must be >= 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"seed": -3}, r"seed must be an integer in \[0, 2\*\*63\)"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        batchspec.SamplingParams(**kwargs)


def test_mixed_window_layers_of_an_untested_family_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, sliding_window=8, use_sliding_window=True, max_window_layers=1)
    model = Qwen2ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="does not serve exactly"):
        batchspec.LLM(model)


def test_unsupported_attention_refused():
    model = tiny._build("llama", 0, torch.float64, "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2'"):
        batchspec.LLM(model)


@pytest.mark.parametrize("kwargs, param", [
    ({"top_k": 2**63}, "top_k"),  # failed mid-generate (int64 overflow in the engine step) before it was bounded
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 10**5000}, "top_k"),  # too long for Python to print: the message gives its size
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": 10000.5}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": float("inf")}, "top_p"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"stop_token_ids": [1, 2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_sampling_params_are_bounded(kwargs, param):
    with pytest.raises(batchspec.params.ParamError) as e:
        batchspec.SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError) and e.value.param == param and len(str(e.value)) < 200


def test_sampling_params_bounds_are_inclusive():
    sp = batchspec.SamplingParams(max_tokens=2**31 - 1, temperature=1e4, top_k=2**31 - 1, top_p=1e-9,
                                  seed=2**63 - 1, stop_token_ids=[2**63 - 1])
    assert (sp.max_tokens, sp.top_k, sp.seed) == (2**31 - 1, 2**31 - 1, 2**63 - 1)


def test_top_k_beyond_the_vocabulary_runs_and_filters_nothing(llm):
    def run(top_k):
        sp = batchspec.SamplingParams(max_tokens=10, temperature=0.8, top_k=top_k, seed=5)
        return [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], sp)]

    assert run(2**31 - 1) == run(tiny.VOCAB * 4) == run(0)


def test_params_changed_after_construction_fail_before_any_work(llm):
    sp = batchspec.SamplingParams(max_tokens=4)
    sp.top_k = 2**63
    with pytest.raises(ValueError, match="top_k must be an integer >= 0 and < 2"):
        llm.generate([[1, 2]], sp)


def test_engine_refuses_a_request_that_would_fail_its_batch(llm):
    """``Engine.add_request`` checks what the batch's tensors hold: a bad request never joins, and the request
    already waiting runs to the batch-size-1 output."""
    from batchspec.engine.engine import Request

    engine = llm.engine()
    prompt = [3, 1, 4, 1, 5]
    good = engine.add_request(Request(prompt, 12, set(), id=None))
    bad = [
        dict(top_k=2**63), dict(seed=2**64), dict(temperature=float("inf")), dict(temperature=float("nan")),
        dict(top_p=0.0), dict(top_p=float("nan")), dict(max_tokens=0), dict(max_tokens=2**63), dict(prompt=[]),
        dict(prompt=[tiny.VOCAB]), dict(prompt=[-1]), dict(prompt=[1.5]), dict(prompt=[True]),
        dict(max_tokens=256), dict(stop_ids={2**63}), dict(stop_ids={-1}),
    ]
    for change in bad:
        fields = {"prompt": [1, 2], "max_tokens": 4, "stop_ids": set(), **change}
        with pytest.raises(ValueError, match="request"):
            engine.add_request(Request(**fields))
    assert [r.id for r in engine.waiting] == [good]
    out = {}
    while engine.has_work():
        for o in engine.step():
            if o.finished is not None:
                out[o.request_id] = o.finished.token_ids
    assert out == {good: tiny.oracle(tiny.target("llama"), prompt, 12)}
