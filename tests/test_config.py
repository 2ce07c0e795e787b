"""``EngineConfig`` is ``LLM``'s arguments, field for field; the sampling checks are one set (``check_sampling``)
that ``SamplingParams``, the engine's ``check_request`` and the server's request validation all apply."""

import dataclasses
import inspect

import pytest
import tiny

import batchspec
from batchspec import EngineConfig, SamplingParams
from batchspec.engine.engine import Request, check_request
from batchspec.params import ParamError
from batchspec.serve import protocol as P


def test_engine_config_fields_are_llm_arguments_with_the_same_defaults():
    """The two lists cannot drift apart: same names, same order, same defaults."""
    params = list(inspect.signature(batchspec.LLM.__init__).parameters.values())[1:]  # without self
    fields = dataclasses.fields(EngineConfig)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == default, p.name


def test_llm_keeps_its_config_and_from_config_builds_the_same():
    llm = batchspec.LLM(tiny.target(), draft=tiny.draft(), num_draft_tokens=3, batch_size=2, speculation="fixed",
                        weights="fp32", prefix_cache=0)
    assert llm.config == EngineConfig(tiny.target(), draft=tiny.draft(), num_draft_tokens=3, batch_size=2,
                                      speculation="fixed", weights="fp32", prefix_cache=0)
    again = batchspec.LLM.from_config(llm.config)
    assert (again.config, again.k, again.batch_size, again.weights_mode) == (llm.config, 3, 2, "fp32")
    prompts, sp = tiny.prompts(3, seed=2), SamplingParams(max_tokens=8)
    want = [tiny.oracle(tiny.target(), p, 8) for p in prompts]
    for built in (llm, again):
        assert [o.token_ids for o in built.generate(prompts, sp)] == want


@pytest.mark.parametrize("kwargs, match", [
    ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"prefix_cache": -1}, "prefix_cache must be a whole number"),
    ({"graphs": "sometimes"}, "graphs must be one of"),
])
def test_engine_config_refuses_bad_values_before_any_model_loads(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig("no-such-model-anywhere", **kwargs)  # a model that would fail to load: never tried


# one bad value each; the server takes them under the same names (seed and stop ids have wire rules of their own)
BAD = [
    {"max_tokens": 0},
    {"max_tokens": 2**31},
    {"temperature": -0.5},
    {"temperature": 1e5},
    {"top_k": -2},
    {"top_k": 2**31},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"logprobs": 21},
    {"min_p": 1.5},
    {"repetition_penalty": 0.0},
    {"presence_penalty": -2.5},
    {"frequency_penalty": float("nan")},
    {"min_tokens": -1},
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: "-".join(f"{k}={v}" for k, v in b.items()))
def test_one_message_from_sampling_params_the_engine_and_the_server(bad):
    (name, value), = bad.items()
    with pytest.raises(ParamError) as sp:
        SamplingParams(**bad)
    assert sp.value.param == name
    engine_fields = {"max_tokens": 4, **bad}
    with pytest.raises(ParamError) as engine:
        check_request(Request([1, 2], engine_fields.pop("max_tokens"), **engine_fields, id=7))
    assert (engine.value.param, str(engine.value)) == (name, f"request 7: {sp.value}")
    info = P.ModelInfo(name="m", vocab_size=tiny.VOCAB, context=256)
    with pytest.raises(P.APIError) as server:
        P.parse_completion({"prompt": [1, 2], **bad}, info)
    assert (server.value.status, server.value.param, server.value.message) == (400, name, str(sp.value))


def test_the_server_names_the_field_as_the_request_gave_it():
    info = P.ModelInfo(name="m", vocab_size=tiny.VOCAB, context=256, tokenizer=tiny.tokenizer())
    body = {"messages": [{"role": "user", "content": "w4"}], "logprobs": True, "top_logprobs": 21,
            "max_completion_tokens": 3}
    with pytest.raises(P.APIError) as e:
        P.parse_chat(body, info)
    assert e.value.param == "top_logprobs" and e.value.message.startswith("top_logprobs must be")
    with pytest.raises(P.APIError) as e:
        P.parse_chat({**body, "top_logprobs": 2, "max_completion_tokens": 0}, info)
    assert e.value.param == "max_completion_tokens" and e.value.message.startswith("max_completion_tokens must be")


def test_the_engine_takes_the_checked_values():
    """numpy numbers (refused before, or kept as they came) become plain Python values."""
    import numpy as np

    r = Request([1, 2], np.int64(5), {np.int64(3)}, np.float32(0.5), np.int32(4), 1, np.uint64(9), logprobs=np.int8(2))
    check_request(r, tiny.VOCAB)
    values = (r.max_tokens, r.stop_ids, r.temperature, r.top_k, r.top_p, r.seed, r.logprobs)
    assert values == (5, {3}, 0.5, 4, 1.0, 9, 2)
    assert [type(v) for v in values] == [int, set, float, int, float, int, int]
