"""Prompt log-probabilities: offline (``SamplingParams(prompt_logprobs=k)``) and through the server (completions
``echo`` with ``logprobs``, vLLM's ``prompt_logprobs`` on completions and chat, with the official ``openai`` client),
each value checked against HF's own forward of the whole prompt at batch size 1, log-softmax at every position."""

import pytest
import servekit
import tiny
import torch

import batchspec
from batchspec.engine.engine import Request, check_request
from batchspec.params import ParamError, SamplingParams

TOL = 1e-9  # float64 models


def reference(model, prompt):
    """HF's log-softmax at each prompt position: ``[len(prompt), V]``, row i the distribution of token i + 1."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        return model(ids, attention_mask=torch.ones_like(ids)).logits[0].log_softmax(-1).double()


def check(model, prompt, entries, k):
    """``entries`` (``RequestOutput.prompt_logprobs``): None, then each prompt token's value, rank and top k, HF's."""
    ref = reference(model, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for i, e in enumerate(entries[1:]):
        want = ref[i]
        assert e.token_id == prompt[i + 1]
        assert abs(e.logprob - float(want[e.token_id])) < TOL, (i, e.logprob, float(want[e.token_id]))
        assert e.rank == 1 + int((want > want[e.token_id]).sum())
        top = want.topk(k)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert all(abs(v - w) < TOL for (_, v), w in zip(e.top, top.values.tolist()))


@pytest.mark.parametrize("arch, eagle", [("llama", False), ("gpt2", False), ("qwen3", False), ("llama", True)])
def test_offline_equal_hf_and_tokens_unchanged(arch, eagle):
    """Rows that ask and rows that do not, of many lengths (one token included), in one batch with a draft model (or
    a head that reads the target's hidden states) and the prefix cache (warmed first, so the rows that ask would start
    from cached blocks): every value equals HF's and every row's tokens are those it gets without them."""
    target = tiny.target(arch)
    draft = tiny.eagle() if eagle else tiny.draft(arch)
    llm = batchspec.LLM(target, draft=draft, num_draft_tokens=3, batch_size=4, prefix_cache=4)
    prompts = tiny.prompts(7, seed=5, lo=1, hi=50) + [[7]]
    prompts[1] = prompts[0][:40] + [3, 4, 5] if len(prompts[0]) >= 40 else prompts[0] + [3, 4, 5]  # a shared start
    plain = llm.generate(prompts, SamplingParams(max_tokens=6))
    asks = [SamplingParams(max_tokens=6, prompt_logprobs=i % 4 if i % 2 == 0 or i == 7 else None)
            for i in range(len(prompts))]
    outs = llm.generate(prompts, asks)
    for p, o, sp, base in zip(prompts, outs, asks, plain):
        assert o.token_ids == base.token_ids
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            check(target, p, o.prompt_logprobs, sp.prompt_logprobs)
    assert base.prompt_logprobs is None


def test_prompt_logprobs_bounds():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    for bad in (-1, 21, True, 2.5):
        with pytest.raises(ParamError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"
        with pytest.raises(ParamError):
            check_request(Request([1, 2], 4, seed=0, prompt_logprobs=bad))


def test_continuous_engine_joining_rows():
    """Requests that ask join a running batch at different steps (continuous batching): the values come on each
    request's first output and on its ``Finished``, equal to HF's."""
    target = tiny.target()
    llm = batchspec.LLM(target, draft=tiny.draft(), num_draft_tokens=3, batch_size=3, scheduler="continuous")
    engine = llm.engine()
    prompts = tiny.prompts(5, seed=9, lo=3, hi=30)
    firsts, finished = {}, {}
    ids, reqs = llm.requests(prompts, [SamplingParams(max_tokens=8, prompt_logprobs=2 if i != 2 else None)
                                       for i in range(5)])
    engine.add_request(reqs[0])
    pending = reqs[1:]
    while engine.has_work() or pending:
        if pending and engine.rounds % 2:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            if o.request_id not in firsts:
                firsts[o.request_id] = o.prompt_logprobs
            else:
                assert o.prompt_logprobs is None  # only the first output carries them
            if o.finished is not None:
                finished[o.request_id] = o.finished
    for i, p in enumerate(ids):
        if i == 2:
            assert firsts[i] is None and finished[i].prompt_logprobs is None
            continue
        check(target, p, firsts[i], 2)
        assert finished[i].prompt_logprobs == firsts[i]


# ------------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def server():
    with servekit.served() as srv:
        yield srv, servekit.client(srv.url)


def _echoed(ref, prompt, lp, k):
    """The echoed prompt part of a completions ``logprobs`` equals HF's (first token None)."""
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(prompt)] == [f"w{t}" for t in prompt]
    for i in range(1, len(prompt)):
        want = ref[i - 1]
        assert abs(lp.token_logprobs[i] - float(want[prompt[i]])) < TOL
        top = want.topk(k)
        expect = {f"w{t}": v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        expect.setdefault(f"w{prompt[i]}", float(want[prompt[i]]))
        got = lp.top_logprobs[i]
        assert set(got) == set(expect) and all(abs(got[t] - expect[t]) < TOL for t in expect)


def test_echo_max_tokens_0(server):
    srv, client = server
    prompt = [5, 17, 9, 33, 41, 2, 60]
    text = " ".join(f"w{t}" for t in prompt)
    r = client.completions.create(model="tiny", prompt=text, echo=True, logprobs=3, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(prompt)
    # where each token starts: the length of the text the tokens before it decode to
    assert c.logprobs.text_offset == [len(" ".join(f"w{t}" for t in prompt[:i])) for i in range(len(prompt))]
    _echoed(reference(tiny.target(), prompt), prompt, c.logprobs, 3)


def test_echo_with_output_and_loglikelihood(server):
    """lm-eval's log-likelihood request: context + continuation as ids, echo, logprobs, max_tokens 1; the sum of the
    continuation tokens' log-probabilities equals HF's, and the generated token is the oracle's."""
    srv, client = server
    context, continuation = [12, 7, 88, 3, 3, 50], [21, 64, 8]
    prompt = context + continuation
    r = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
    c = r.choices[0]
    ref = reference(tiny.target(), prompt)
    _echoed(ref, prompt, c.logprobs, 2)
    assert len(c.logprobs.token_logprobs) == len(prompt) + 1
    got = sum(c.logprobs.token_logprobs[len(context) : -1])
    want = sum(float(ref[i - 1, prompt[i]]) for i in range(len(context), len(prompt)))
    assert abs(got - want) < TOL
    out = tiny.oracle(tiny.target(), prompt, 1)
    assert c.logprobs.tokens[-1] == f"w{out[0]}" and c.text.endswith(f"w{out[0]}")
    assert c.text.startswith(" ".join(f"w{t}" for t in prompt))
    assert c.logprobs.text_offset[len(prompt)] == len(" ".join(f"w{t}" for t in prompt))
    # longer output, without logprobs: the prompt's text then the oracle's tokens
    r = client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert r.choices[0].logprobs is None and r.choices[0].model_extra["token_ids"] == tiny.oracle(tiny.target(),
                                                                                                  prompt, 5)
    assert r.choices[0].text.startswith(" ".join(f"w{t}" for t in prompt))


def _vllm(ref, prompt, entries, k):
    assert entries[0] is None and len(entries) == len(prompt)
    for i, item in enumerate(entries[1:], 1):
        want, tok = ref[i - 1], prompt[i]
        assert abs(item[str(tok)]["logprob"] - float(want[tok])) < TOL
        assert item[str(tok)]["rank"] == 1 + int((want > want[tok]).sum())
        assert item[str(tok)]["decoded_token"] == f"w{tok}"
        top = want.topk(k)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            entry = item[str(t)]
            assert abs(entry["logprob"] - v) < TOL and entry["rank"] == rank
        assert len(item) in (k, k + 1)


def test_prompt_logprobs_chat_and_completions(server):
    srv, client = server
    tok = servekit.tokenizer()
    messages = [{"role": "user", "content": "w4 w9 w31"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    _vllm(reference(tiny.target(), prompt), list(prompt), r.model_extra["prompt_logprobs"], 2)
    prompt = [8, 8, 40, 1, 77]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 3})
    _vllm(reference(tiny.target(), prompt), prompt, r.choices[0].model_extra["prompt_logprobs"], 3)
    assert r.choices[0].text == " ".join(f"w{t}" for t in tiny.oracle(tiny.target(), prompt, 2))  # no echo


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2], "echo": True, "stream": True}, "echo"),
    ({"prompt": [1, 2], "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt": [1, 2], "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),  # without echo
])
def test_refused(server, body, param):
    import httpx

    srv, _ = server
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
