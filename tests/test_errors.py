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


def test_sliding_window_model_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    model = MistralForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="sliding-window"):
        batchspec.LLM(model)


def test_unsupported_attention_refused():
    model = tiny._build("llama", 0, torch.float64, "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2'"):
        batchspec.LLM(model)
