"""Log-probabilities and n choices: in the engine (``SamplingParams(logprobs=k)`` through ``LLM.generate`` and the
step-able engine) and through the server (real HTTP, the official ``openai`` client), each value checked against the
independent oracle: HF's own forward of prompt + output at batch size 1, log-softmax at every emitted position."""

import threading

import httpx
import pytest
import servekit
import tiny
import torch

import batchspec
from batchspec.engine.engine import Request, check_request
from batchspec.params import MAX_LOGPROBS, ParamError, SamplingParams
from batchspec.serve.app import create_app
from batchspec.serve.protocol import MAX_N
from batchspec.serve.server import ServerThread

MODEL = "tiny"
TOL = 1e-5
PROMPTS = tiny.prompts(8, seed=11, lo=4, hi=36)  # every other one repeats a phrase: prompt lookup finds matches


def reference(model, prompt, out):
    """HF's log-softmax at each output position: one batch-size-1 forward of prompt + output, ``[len(out), V]``."""
    ids = torch.tensor([list(prompt) + list(out)])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)].log_softmax(-1).double()


def check(model, prompt, out, entries, k):
    """``entries``: (token id, logprob, [(id, logprob)] of the top k) per output token; each equals HF's."""
    ref = reference(model, prompt, out)
    assert len(entries) == len(out) > 0
    for j, (tok, lp, top) in enumerate(entries):
        assert tok == out[j]
        assert abs(lp - float(ref[j, tok])) < TOL, (j, lp, float(ref[j, tok]))
        want = ref[j].topk(k)
        assert [t for t, _ in top] == want.indices.tolist(), j
        assert all(abs(v - w) < TOL for (_, v), w in zip(top, want.values.tolist()))
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        if tok in want.indices.tolist():
            assert any(t == tok and abs(v - lp) < 1e-12 for t, v in top)


def _entries(output):
    return [(e.token_id, e.logprob, e.top) for e in output.logprobs]


# ------------------------------------------------------------------------------------------------ the engine


def test_sampling_params_logprobs_bounds():
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20
    assert SamplingParams().logprobs is None
    for bad in (-1, 21, True, 2.5, "3"):
        with pytest.raises(ParamError) as e:
            SamplingParams(logprobs=bad)
        assert e.value.param == "logprobs"
    for bad in (21, -1, True):
        with pytest.raises(ValueError, match="logprobs"):
            check_request(Request([1, 2], 4, logprobs=bad))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("draft,scheduler", [(None, "static"), ("prompt-lookup", "continuous"), ("model", "static"),
                                             ("prompt-lookup", "exspec")])
def test_generate_logprobs_equal_hf(draft, scheduler, dtype):
    """Rows asking for 0, 3 or 20 alternatives next to rows asking for none, greedy and sampled, in one batch: every
    emitted token's logprob and top alternatives are HF's (raw logits, whatever the temperature), whether the token
    was an accepted draft or the target's own; rows that asked for none get None."""
    target = tiny.target(dtype=dtype)
    drafter = tiny.draft(dtype=dtype) if draft == "model" else draft
    llm = tiny.fixed_llm(target, draft=drafter, num_draft_tokens=3, batch_size=4, scheduler=scheduler)
    asks = [3, None, 20, 0, 1, None, 5, 2]
    temps = [0.0, 0.0, 0.0, 0.9, 0.0, 0.7, 1.3, 0.0]
    params = [SamplingParams(max_tokens=14, temperature=t, seed=i, logprobs=k)
              for i, (t, k) in enumerate(zip(temps, asks))]
    outs = llm.generate(PROMPTS, params)
    for i, (o, k, t) in enumerate(zip(outs, asks, temps)):
        if t == 0:
            assert o.token_ids == tiny.oracle(target, PROMPTS[i], 14), i
        if k is None:
            assert o.logprobs is None
        else:
            check(target, PROMPTS[i], o.token_ids, _entries(o), k)
    if draft is not None:
        assert llm.stats.accepted > 0  # speculation really produced some of the tokens checked
    if scheduler == "exspec":
        assert llm.stats.grouped_rounds + llm.stats.fallback_rounds > 0


def test_step_outputs_carry_logprobs_and_aborts_keep_theirs():
    """The step-able engine: each StepOutput's logprobs go one per new token and add up to the Finished's; an aborted
    request keeps the logprobs of the tokens it had."""
    target = tiny.target()
    llm = tiny.fixed_llm(target, draft="prompt-lookup", num_draft_tokens=3, batch_size=4, scheduler="continuous")
    _, reqs = llm.requests(PROMPTS[:3], [SamplingParams(max_tokens=20, logprobs=2)] * 3)
    engine = llm.engine()
    for r in reqs:
        r.id = None
        engine.add_request(r)
    streamed, finished, steps = {}, {}, 0
    while engine.has_work():
        steps += 1
        if steps == 4:
            assert engine.abort(reqs[2].id)
        for o in engine.step():
            assert o.logprobs is not None and len(o.logprobs) == len(o.new_token_ids)
            assert [e.token_id for e in o.logprobs] == o.new_token_ids
            streamed.setdefault(o.request_id, []).extend(o.logprobs)
            if o.finished is not None:
                finished[o.request_id] = o.finished
    assert finished[reqs[2].id].reason == "abort" and 0 < len(finished[reqs[2].id].token_ids) < 20
    for r in reqs:
        f = finished[r.id]
        assert f.logprobs == streamed[r.id] and len(f.logprobs) == len(f.token_ids)
        check(target, r.prompt, f.token_ids, [(e.token_id, e.logprob, e.top) for e in f.logprobs], 2)


# ------------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def spec_server():
    """The tiny target with its draft, drafting K = 3 every round (so drafts are verified and accepted)."""
    app = create_app(servekit.llm(speculation="fixed"), model_name=MODEL)
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server():
    llm = batchspec.LLM(tiny.target(), scheduler="continuous", batch_size=4, tokenizer=servekit.tokenizer())
    app = create_app(llm, model_name=MODEL)
    with ServerThread(app) as s:
        yield s


def _extra(obj, key):
    return (obj.model_extra or {}).get(key)


def _id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token[len("token_id:"):])


def _completion_entries(lp, token_ids, as_ids):
    """(id, logprob, top) from the legacy shape; ``top`` without the chosen token when OpenAI adds it beyond k."""
    tok = servekit.tokenizer()
    vocab = {tok.decode([i]): i for i in range(tiny.VOCAB)}
    entries = []
    for j, (name, value, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        tid = _id(name) if as_ids else vocab[name]
        assert tid == token_ids[j]
        pairs = [(_id(t) if as_ids else vocab[t], v) for t, v in top.items()]
        assert [v for _, v in pairs] == sorted((v for _, v in pairs), reverse=True)  # most likely first
        assert any(t == tid and v == value for t, v in pairs)  # the chosen token is always there (OpenAI)
        entries.append((tid, value, pairs))
    return entries


def _check_completion(prompt, token_ids, text, lp, k, as_ids):
    entries = _completion_entries(lp, token_ids, as_ids)
    ref = reference(tiny.target(), prompt, token_ids)
    for j, (tid, _, pairs) in enumerate(entries):
        top_k = ref[j].topk(k).indices.tolist()
        extra = [] if tid in top_k else [(tid, pairs[[t for t, _ in pairs].index(tid)][1])]
        assert sorted(t for t, _ in pairs) == sorted(top_k + [t for t, _ in extra])
    check(tiny.target(), prompt, token_ids,
          [(tid, v, [(t, x) for t, x in pairs if t in ref[j].topk(k).indices.tolist()])
           for j, (tid, v, pairs) in enumerate(entries)], k)
    tok = servekit.tokenizer()
    for j, off in enumerate(lp.text_offset):  # where the text of the tokens before token j ends
        assert off == len(tok.decode(token_ids[:j], skip_special_tokens=True))
        if token_ids[j] != 0:  # w0 is the pad token: not in the text; the others follow a space (word-level)
            assert text[off:].lstrip(" ").startswith(tok.decode([token_ids[j]]))


@pytest.mark.parametrize("which", ["spec", "plain"])
@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_logprobs_equal_hf(which, as_ids, spec_server, plain_server):
    """/v1/completions with logprobs=5, streamed and not, with speculation (drafts accepted) and without: the legacy
    shape, every value HF's, the stream's pieces adding up to the non-streamed answer."""
    server = spec_server if which == "spec" else plain_server
    llm = server.app.state.llm
    client = servekit.client(server.url)
    accepted = llm.stats.accepted
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": as_ids}
    for i in (0, 1, 3):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0, logprobs=5,
                                      extra_body=extra)
        choice = r.choices[0]
        ids = _extra(choice, "token_ids")
        assert ids == tiny.oracle(tiny.target(), PROMPTS[i], 16)
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
        _check_completion(PROMPTS[i], ids, choice.text, lp, 5, as_ids)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0,
                                                logprobs=5, stream=True, extra_body=extra))
        pieces = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
        assert len(pieces) > 1  # streamed in pieces
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in pieces for x in getattr(p, field)] == getattr(lp, field), field
        assert [t for c in chunks for t in _extra(c.choices[0], "token_ids")] == ids
    if which == "spec":
        assert llm.stats.accepted > accepted  # drafts were accepted while these answers were made
    else:
        assert llm.stats.drafted == 0


@pytest.mark.parametrize("which", ["spec", "plain"])
@pytest.mark.parametrize("as_ids", [False, True])
def test_chat_logprobs_equal_hf(which, as_ids, spec_server, plain_server):
    """/v1/chat/completions with logprobs: true, top_logprobs: 4, streamed and not: OpenAI's content shape (token,
    logprob, bytes, top_logprobs), every value HF's."""
    server = spec_server if which == "spec" else plain_server
    tok = servekit.tokenizer()
    client = servekit.client(server.url)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": as_ids}
    for i in range(3):
        messages = [{"role": "user", "content": " ".join(f"w{(i * 11 + j * 5) % 90 + 4}" for j in range(4 + i))}]
        prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=4, extra_body=extra)
        choice = r.choices[0]
        ids = _extra(choice, "token_ids")
        assert ids == tiny.oracle(tiny.target(), prompt, 12)
        content = choice.logprobs.content
        name = _id if as_ids else (lambda t: tok.convert_tokens_to_ids(t))
        entries = []
        for c in content:
            assert c.bytes == list(c.token.encode()) and all(a.bytes == list(a.token.encode())
                                                               for a in c.top_logprobs)
            entries.append((name(c.token), c.logprob, [(name(a.token), a.logprob) for a in c.top_logprobs]))
        check(tiny.target(), prompt, ids, entries, 4)
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                     logprobs=True, top_logprobs=4, stream=True, extra_body=extra))
        streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
        assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]


def test_chat_logprobs_without_alternatives(plain_server):
    """logprobs: true alone gives each token's logprob and no alternatives."""
    client = servekit.client(plain_server.url)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w9"}], max_tokens=6,
                                       temperature=0, logprobs=True, extra_body={"return_token_ids": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(c.top_logprobs == [] for c in content)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w9"}],
                                           max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_equal_single_requests_with_consecutive_seeds(spec_server):
    """n=4 with seed s: the four choices are the answers of four single requests with seeds s..s+3 (tokens and
    logprobs); streamed, each chunk names its choice and the pieces of each choice add up to it; usage counts the
    prompt once and the completion tokens of all four."""
    client = servekit.client(spec_server.url)
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.5, logprobs=1,
              extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    r = client.completions.create(n=4, seed=1234, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    singles = [client.completions.create(seed=1234 + i, **kw).choices[0] for i in range(4)]
    for c, s in zip(r.choices, singles):
        assert _extra(c, "token_ids") == _extra(s, "token_ids") and c.text == s.text
        # the same tokens; values the same up to the summation order of another batch
        assert c.logprobs.tokens == s.logprobs.tokens and c.logprobs.text_offset == s.logprobs.text_offset
        assert all(abs(x - y) < TOL for x, y in zip(c.logprobs.token_logprobs, s.logprobs.token_logprobs))
        for x, y in zip(c.logprobs.top_logprobs, s.logprobs.top_logprobs):
            assert list(x) == list(y) and all(abs(x[t] - y[t]) < TOL for t in x)
        assert c.finish_reason == s.finish_reason
    assert len({tuple(_extra(c, "token_ids")) for c in r.choices}) > 1  # four samples, not one
    # temperature 1.5 picks tokens outside the top 1: their entries add the chosen token (2 entries)
    assert any(len(t) == 2 for c in r.choices for t in c.logprobs.top_logprobs)
    for c in r.choices:
        _check_completion(PROMPTS[2], _extra(c, "token_ids"), c.text, c.logprobs, 1, True)
    total = sum(len(_extra(c, "token_ids")) for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPTS[2]), total)

    chunks = list(client.completions.create(n=4, seed=1234, stream=True, stream_options={"include_usage": True},
                                            **kw))
    by_index = {}
    for ch in chunks[:-1]:
        (c,) = ch.choices
        by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1, 2, 3]
    for i, parts in by_index.items():
        assert [t for p in parts for t in _extra(p, "token_ids")] == _extra(r.choices[i], "token_ids")
        assert "".join(p.text for p in parts) == r.choices[i].text
        assert [x for p in parts if p.logprobs for x in p.logprobs.token_logprobs] == \
            r.choices[i].logprobs.token_logprobs
        assert [p.finish_reason for p in parts if p.finish_reason] == [r.choices[i].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == total
    assert chunks[-1].usage.prompt_tokens == len(PROMPTS[2])


def test_n_greedy_chat_choices_are_identical(spec_server):
    client = servekit.client(spec_server.url)
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1 and r.choices[0].message.content
    assert r.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=3,
                                                 stream=True))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    for i in range(3):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == r.choices[0].message.content


BAD = [
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "top_logprobs": 3}, "top_logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "n": MAX_N + 1}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "n": 10**30}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "n": "2"}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}], "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w4"}], "n": MAX_N + 1}, "n"),
]


def test_bad_logprobs_and_n_are_400s_and_disturb_nothing(spec_server):
    client = servekit.client(spec_server.url)
    good = {}

    def background():
        good["r"] = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                              logprobs=2, extra_body={"return_token_ids": True})

    t = threading.Thread(target=background)
    t.start()
    with httpx.Client(base_url=spec_server.url, timeout=30) as http:
        for path, body, param in BAD:
            r = http.post(path, json={"model": MODEL, **body})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], body
            assert "Traceback" not in err["message"]
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "n": MAX_N, "max_tokens": 2,
                                                "temperature": 0})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_N
    t.join(60)
    choice = good["r"].choices[0]
    assert _extra(choice, "token_ids") == tiny.oracle(tiny.target(), PROMPTS[0], 30)
    assert len(choice.logprobs.token_logprobs) == 30


def test_n_beyond_what_the_server_holds_is_a_400_not_a_429():
    """With room for 4 + 1 requests in flight, n = 6 could never be taken: 400 naming n; n = 5 is served."""
    llm = batchspec.LLM(tiny.target(), scheduler="continuous", batch_size=4, tokenizer=servekit.tokenizer())
    with ServerThread(create_app(llm, model_name=MODEL, max_queue=1)) as s, httpx.Client(base_url=s.url,
                                                                                          timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "n": 6, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "n": 5, "max_tokens": 2,
                                               "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"]) == 5


@pytest.mark.parametrize("draft", ["model", "prompt-lookup"])
def test_speculation_leaves_every_logprob_as_plain_decoding_has_it(draft):
    """fp32: greedy rows under speculation (fixed K, ragged acceptance, holes) at batch 4 get the tokens and, bit for
    bit, the log-probabilities and alternatives plain decoding at batch 1 gives them."""
    target = tiny.target(dtype=torch.float32)
    params = SamplingParams(max_tokens=16, logprobs=3)
    plain = tiny.fixed_llm(target, draft=None, batch_size=1)
    want = [plain.generate([p], params)[0] for p in PROMPTS]
    llm = tiny.fixed_llm(target, draft=tiny.draft(dtype=torch.float32) if draft == "model" else draft,
                         num_draft_tokens=3, batch_size=4)
    got = llm.generate(PROMPTS, params)
    assert llm.stats.accepted > 0 and llm.stats.ragged_rounds > 0  # drafts verified, rows accepting differently
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        entries = [[(e.token_id, e.logprob, e.top) for e in o.logprobs] for o in (g, w)]
        assert entries[0] == entries[1]
