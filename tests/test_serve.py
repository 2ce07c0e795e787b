"""The OpenAI-compatible server end to end: a real uvicorn server on 127.0.0.1 in a background thread, over tiny
in-process models, called through the official ``openai`` client (and raw HTTP where the client hides the wire)."""

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import servekit
import tiny

from batchspec.serve.app import create_app
from batchspec.serve.protocol import MAX_PROMPTS, PREFILL_TOKENS, TextStream
from batchspec.serve.server import ServerThread

MODEL = "tiny"
PROMPTS = tiny.prompts(16, seed=5, lo=1, hi=40)


_llm, _client, _slow, _wait = servekit.llm, servekit.client, servekit.slow, servekit.wait


@pytest.fixture(scope="module")
def server():
    app = create_app(_llm(), model_name=MODEL)
    with ServerThread(app) as s:
        yield s


def _extra(choice, key):
    return (choice.model_extra or {}).get(key)


# ------------------------------------------------------------------------------------------------ exactness


def test_concurrent_completions_equal_batch1_greedy(server):
    """16 requests at once through a batch of 4 rows (draft model: ragged acceptance, joins at round boundaries):
    every output is the batch-size-1 greedy output, with its finish reason and usage."""
    client = _client(server.url)
    lengths = [4 + (i * 7) % 21 for i in range(len(PROMPTS))]

    def call(i):
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                         extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(call, range(len(PROMPTS))))
    for i, r in enumerate(outs):
        choice = r.choices[0]
        want = tiny.oracle(tiny.target(), PROMPTS[i], lengths[i])
        assert _extra(choice, "token_ids") == want, i
        assert _extra(choice, "prompt_token_ids") == PROMPTS[i]
        assert choice.finish_reason == "length"
        assert choice.text == servekit.tokenizer().decode(want, skip_special_tokens=True)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPTS[i]), lengths[i])
        assert r.usage.total_tokens == len(PROMPTS[i]) + lengths[i]
        assert r.model == MODEL and r.object == "text_completion"


def test_streamed_equals_non_streamed(server):
    """Concurrent streams: token ids and text concatenated equal the non-streamed answer; only the last chunk has a
    finish reason and it carries the usage."""
    client = _client(server.url)

    def stream(i):
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=20, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}))
        return chunks

    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(stream, range(8)))
    for i, chunks in enumerate(streams):
        plain = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=20, temperature=0,
                                          extra_body={"return_token_ids": True}).choices[0]
        ids = [t for c in chunks for t in _extra(c.choices[0], "token_ids")]
        assert ids == _extra(plain, "token_ids") == tiny.oracle(tiny.target(), PROMPTS[i], 20)
        assert "".join(c.choices[0].text for c in chunks) == plain.text
        assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(PROMPTS[i])
        assert _extra(chunks[0].choices[0], "prompt_token_ids") == PROMPTS[i]
        assert len({c.id for c in chunks}) == 1


def test_chat_with_template_streamed_and_not(server):
    tok = servekit.tokenizer()
    client = _client(server.url)
    messages = [[{"role": "user", "content": " ".join(f"w{(i * 13 + j * 7) % 90 + 4}" for j in range(3 + i))}]
                for i in range(6)]

    def both(m):
        plain = client.chat.completions.create(model=MODEL, messages=m, max_tokens=12, temperature=0,
                                               extra_body={"return_token_ids": True})
        chunks = list(client.chat.completions.create(model=MODEL, messages=m, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        return plain, chunks

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(both, messages))
    for m, (plain, chunks) in zip(messages, results):
        ids = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
        want = tiny.oracle(tiny.target(), list(ids), 12)
        choice = plain.choices[0]
        assert _extra(choice, "token_ids") == want and _extra(choice, "prompt_token_ids") == list(ids)
        assert choice.message.role == "assistant"
        assert choice.message.content == tok.decode(want, skip_special_tokens=True)
        assert plain.object == "chat.completion" and plain.usage.completion_tokens == 12
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
        with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(with_reason) == 1 and with_reason[0].choices[0].finish_reason == "length"
        assert with_reason[0].usage.completion_tokens == 12
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ids) + 12  # include_usage


def test_text_prompt_and_stop_strings(server):
    tok = servekit.tokenizer()
    client = _client(server.url)
    text_prompt = "w5 w17 w33 w60 w8"
    ids = tok(text_prompt)["input_ids"]
    full = tiny.oracle(tiny.target(), ids, 24)
    r = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert _extra(r.choices[0], "token_ids") == full
    text = tok.decode(full)
    stop = tok.decode([full[5]])
    n = next(k for k in range(1, len(full) + 1) if stop in tok.decode(full[:k]))
    want_text = text[: text.find(stop)]
    for stream in (False, True):
        got = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=24, temperature=0,
                                        stop=[stop, "never-there"], stream=stream,
                                        extra_body={"return_token_ids": True})
        if stream:
            chunks = list(got)
            got_text = "".join(c.choices[0].text for c in chunks)
            got_ids = [t for c in chunks for t in _extra(c.choices[0], "token_ids")]
            reason = chunks[-1].choices[0].finish_reason
            usage = chunks[-1].usage
        else:
            got_text, got_ids = got.choices[0].text, _extra(got.choices[0], "token_ids")
            reason, usage = got.choices[0].finish_reason, got.usage
        assert got_text == want_text and stop not in got_text
        assert got_ids == full[:n]
        assert reason == "stop" and usage.completion_tokens == n
    # a stop token id: kept in the ids, output ends there
    j = 4
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0,
                                  extra_body={"return_token_ids": True, "stop_token_ids": [full[j]]})
    cut = full.index(full[j]) + 1
    assert _extra(r.choices[0], "token_ids") == full[:cut] and r.choices[0].finish_reason == "stop"
    worker = server.app.state.worker  # the rows cut by stop strings left the engine, counted as "stop"
    assert _wait(worker.idle) and worker.finished["abort"] == 0 and worker.finished["stop"] >= 3


def test_a_list_of_prompts_is_answered_as_single_requests(server):
    """``prompt`` as a list of prompts (text and token ids, as lm-eval's batches send them), with n = 2: prompt i's
    choice j is choice 2i + j and equals the single request's (greedy: batch-size-1 exact); usage adds up. So with
    lm-eval's log-likelihood shape (echo, logprobs, max_tokens 1, seed). A server of 4 + 2 rows refuses 3 prompts of
    n = 3 with a 400 naming the prompt."""
    tok = servekit.tokenizer()
    prompts = ["w5 w17 w33", PROMPTS[1], PROMPTS[2], "w9"]
    ids = [tok(p)["input_ids"] if isinstance(p, str) else p for p in prompts]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 6, "temperature": 0,
                                               "n": 2, "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == list(range(8))
        for c in body["choices"]:
            want = tiny.oracle(tiny.target(), ids[c["index"] // 2], 6)
            assert c["token_ids"] == want and c["prompt_token_ids"] == ids[c["index"] // 2]
            assert c["text"] == tok.decode(want)
        assert body["usage"] == {"prompt_tokens": sum(map(len, ids)), "completion_tokens": 48,
                                 "total_tokens": sum(map(len, ids)) + 48}  # each prompt once, as with n alone
        shape = {"model": MODEL, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
        batch = http.post("/v1/completions", json={**shape, "prompt": ids}).json()
        singles = [http.post("/v1/completions", json={**shape, "prompt": [p]}).json() for p in ids]
        for i, (c, single) in enumerate(zip(batch["choices"], singles)):
            assert c == {**single["choices"][0], "index": i}
    app = create_app(_llm(batch_size=4), model_name=MODEL, max_queue=2)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        _check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [[1], [2], [3]], "n": 3}), 400,
                     "prompt")
        assert app.state.worker.finished["abort"] == 0 and app.state.worker.idle()


def test_sampling_with_seed_is_reproducible(server):
    client = _client(server.url)

    def call(_):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0.9, top_p=0.95,
                                      seed=1234, extra_body={"top_k": 40, "return_token_ids": True})
        return _extra(r.choices[0], "token_ids")

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(call, range(4)))
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 16


# ------------------------------------------------------------------------------------------------ errors


BAD_COMPLETIONS = [
    ({"model": MODEL, "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": "", "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [], "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, tiny.VOCAB], "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [1, -1], "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2.5], "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [[1, 2], [3, tiny.VOCAB]], "max_tokens": 4}, "prompt"),  # the second prompt's id
    ({"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 4, "stream": True}, "prompt"),
    ({"model": MODEL, "prompt": [[1]] * (MAX_PROMPTS + 1), "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [[1], 2], "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": [1] * 200, "max_tokens": 57}, "max_tokens"),  # 257 > context of 256
    ({"model": MODEL, "prompt": [1] * 256, "max_tokens": 1}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": -3}, "max_tokens"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": [1, 2], "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "prompt": [1, 2], "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": [1, 2], "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": [1, 2], "top_k": -2}, "top_k"),
    ({"model": "gpt-4", "prompt": [1, 2]}, "model"),
    ({"model": MODEL, "prompt": [1, 2], "n": 17}, "n"),
    ({"model": MODEL, "prompt": [1, 2], "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": [1, 2], "echo": True, "stream": True}, "echo"),
    ({"model": MODEL, "prompt": [1, 2], "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": [1, 2], "logit_bias": {"999": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": [1, 2], "logit_bias": {"w5": 1}}, "logit_bias"),
    ({"model": MODEL, "prompt": [1, 2], "min_tokens": 17}, "min_tokens"),  # past the default 16
    ({"model": MODEL, "prompt": [1, 2], "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": [1, 2], "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": [1, 2], "stop_token_ids": [999]}, "stop_token_ids"),
    ({"model": MODEL, "prompt": [1, 2], "stream": "yes"}, "stream"),
]
BAD_CHAT = [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "w4"}]}, "messages[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w4"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "w4"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
]


def _check_error(r, status, param="unset"):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if param != "unset":
        assert err["param"] == param, err
    return err


def test_bad_requests_get_openai_errors_and_disturb_nothing(server):
    client = _client(server.url)
    good = {}

    def background():  # a request running while the bad ones come in
        good["r"] = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                              extra_body={"return_token_ids": True})

    t = threading.Thread(target=background)
    t.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, param in BAD_COMPLETIONS:
            err = _check_error(http.post("/v1/completions", json=body), 400, param)
            assert err["type"] == "invalid_request_error"
        for body, param in BAD_CHAT:
            _check_error(http.post("/v1/chat/completions", json=body), 400, param)
        _check_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                     400)
        _check_error(http.post("/v1/completions", json=[1, 2]), 400)
        assert _check_error(http.get("/v1/nowhere"), 404)["type"] == "not_found_error"
        _check_error(http.get("/v1/completions"), 405)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt=[1, 2], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    t.join(30)
    assert _extra(good["r"].choices[0], "token_ids") == tiny.oracle(tiny.target(), PROMPTS[0], 40)
    assert server.app.state.worker.alive


def test_api_key():
    app = create_app(_llm(), model_name=MODEL, api_key="sekret")
    with ServerThread(app) as s:
        with pytest.raises(openai.AuthenticationError) as e:
            _client(s.url, "wrong").completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with httpx.Client(base_url=s.url) as http:
            _check_error(http.get("/v1/models"), 401)
            _check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1]}), 401)
            assert http.get("/health").status_code == 200  # health stays open
            _check_error(http.get("/metrics"), 401)  # the prefix cache's counters tell about others' prompts
            metrics = http.get("/metrics", headers={"Authorization": "Bearer sekret"})
            assert metrics.status_code == 200 and "batchspec_prefix_cache_hits" in metrics.text
        r = _client(s.url, "sekret").completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3
        assert [m.id for m in _client(s.url, "sekret").models.list()] == [MODEL]


# ------------------------------------------------------------------------------------------------ load, aborts


def _open_stream(http, prompt, max_tokens):
    """Start a streamed request and read its headers: it is accepted (its first event comes with its first token)."""
    cm = http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                       "temperature": 0, "stream": True, "return_token_ids": True})
    r = cm.__enter__()
    assert r.status_code == 200
    return cm, r, r.iter_lines()


def _stream_ids(lines):
    """The token ids of the rest of a stream (its events up to ``[DONE]``)."""
    ids = []
    for line in lines:
        if line == "data: [DONE]":
            return ids
        if line.startswith("data:"):
            ids += json.loads(line[5:])["choices"][0]["token_ids"]
    raise AssertionError("the stream ended without [DONE]")


def test_full_queue_429_and_disconnect_aborts_rows():
    """batch 1 + queue 1: a third request in flight gets 429 (OpenAI error JSON, nothing else disturbed); clients
    that hang up have their rows dropped at the next round boundary, and the engine ends up with no work."""
    app = create_app(_llm(batch_size=1), model_name=MODEL, max_queue=1)
    worker = app.state.worker
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        _slow(worker, 0.02)
        a = _open_stream(http, PROMPTS[1], 200)
        b = _open_stream(http, PROMPTS[2], 200)
        assert next(line for line in a[2] if line.startswith("data:"))  # a's first tokens: a round has run
        err = _check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [3, 4], "max_tokens": 2}), 429)
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            _client(s.url).completions.create(model=MODEL, prompt=[3, 4], max_tokens=2)
        metrics = http.get("/metrics").text
        assert 'batchspec_http_requests_total{endpoint="/v1/completions",status="429"} 2.0' in metrics
        assert "batchspec_running_rows 1.0" in metrics and "batchspec_queue_length 1.0" in metrics
        for cm, r, lines in (a, b):  # hang up mid-stream
            cm.__exit__(None, None, None)
        assert _wait(worker.idle), (worker.in_flight, worker.jobs, worker.engine.has_work())
        assert worker.finished["abort"] == 2 and not worker.engine.has_work() and worker.engine.batch is None
        # a non-streamed request whose client gives up is dropped too
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 200,
                                               "temperature": 0}, timeout=0.3)
        assert _wait(worker.idle), (worker.in_flight, worker.jobs)
        assert worker.finished["abort"] == 3, worker.finished
        # and the server serves on, exactly
        del worker.engine._schedule
        r = _client(s.url).completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=9, temperature=0,
                                              extra_body={"return_token_ids": True})
        assert _extra(r.choices[0], "token_ids") == tiny.oracle(tiny.target(), PROMPTS[4], 9)


def test_a_cancelled_request_frees_its_place_at_once():
    """Capacity 4 (2 rows + 2 waiting), all taken, the engine inside a step: two clients hang up and their places are
    free at once (their rows leave at the next round boundary), so two new streams are taken, not refused with 429;
    once the step ends, every stream left runs exactly."""
    app = create_app(_llm(batch_size=2), model_name=MODEL, max_queue=2)
    worker = app.state.worker
    go, step = threading.Event(), worker.engine._schedule

    def held():
        go.wait(30)
        return step()

    worker.engine._schedule = held
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        try:
            streams = [_open_stream(http, PROMPTS[i], 12) for i in range(4)]
            assert worker.in_flight == 4
            _check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [3], "max_tokens": 2}), 429)
            for cm, _, _ in streams[:2]:
                cm.__exit__(None, None, None)
            assert _wait(lambda: worker.in_flight == 2), worker.in_flight
            assert not go.is_set()  # no round boundary has come
            streams[:2] = [_open_stream(http, PROMPTS[i], 12) for i in (4, 5)]
            go.set()
            for i, (cm, _, lines) in zip((4, 5, 2, 3), streams):
                assert _stream_ids(lines) == tiny.oracle(tiny.target(), PROMPTS[i], 12)
                cm.__exit__(None, None, None)
        finally:
            go.set()
        assert _wait(worker.idle) and worker.finished["abort"] == 2, worker.finished


def test_stream_opens_with_its_first_token():
    """The opening chunk (chat's role) goes out with the first token, not before the prefill: with a first step
    that takes 0.5 s, a client's first event comes after the step produced the first token."""
    app = create_app(_llm(), model_name=MODEL)
    worker = app.state.worker
    step, produced = worker.engine.step, []

    def slow_first():
        if not produced:
            time.sleep(0.5)
        outs = step()
        if any(o.new_token_ids for o in outs) and not produced:
            produced.append(time.monotonic())
        return outs

    worker.engine.step = slow_first
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4, "temperature": 0,
            "stream": True}
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines, first = [], None
            for line in r.iter_lines():
                if line.startswith("data:"):
                    first = first or time.monotonic()
                    lines.append(line)
    assert produced and first >= produced[0]
    events = [json.loads(line[5:]) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:])
    assert lines[-1] == "data: [DONE]"


def test_engine_thread_survives_a_failed_step(caplog):
    """A step that raises: the engine drops its rows, the worker starts each request again once (skipping the tokens
    it had streamed), so the clients still get exact outputs; with no retries left they get a 500 error that names
    their request id and not the exception (which is logged with that id); either way the engine thread keeps
    serving."""
    for retries in (1, 0):
        app = create_app(_llm(), model_name=MODEL, retries=retries)
        worker = app.state.worker
        calls = {"n": 0}
        step = worker.engine._schedule

        def flaky():
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("injected failure")
            return step()

        with ServerThread(app) as s:
            worker.engine._schedule = flaky
            client = _client(s.url)

            def call(i):
                try:
                    if i % 2:
                        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24,
                                                                temperature=0, stream=True,
                                                                extra_body={"return_token_ids": True}))
                        return [t for c in chunks for t in _extra(c.choices[0], "token_ids")]
                    r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                                  extra_body={"return_token_ids": True})
                    return _extra(r.choices[0], "token_ids")
                except openai.APIError as e:
                    return e

            with ThreadPoolExecutor(6) as pool:
                outs = list(pool.map(call, range(6)))
            assert worker.errors == 1 and worker.alive
            if retries:
                assert worker.restarts >= 1
                assert outs == [tiny.oracle(tiny.target(), PROMPTS[i], 24) for i in range(6)]
            else:
                failed = [o for o in outs if isinstance(o, openai.APIError)]
                assert failed and not any("injected failure" in str(e) or "RuntimeError" in str(e) for e in failed)
                for e in failed:
                    rid = re.search(r"internal error, request id ((chat)?cmpl-[0-9a-f]+)", str(e)).group(1)
                    assert any(rid in r.getMessage() and "injected failure" in r.getMessage()
                               for r in caplog.records), rid
                    if isinstance(e, openai.APIStatusError):
                        assert e.status_code == 500 and e.body["code"] == "engine_error"
            r = client.completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=10, temperature=0,
                                          extra_body={"return_token_ids": True})
            assert _extra(r.choices[0], "token_ids") == tiny.oracle(tiny.target(), PROMPTS[7], 10)
            assert _wait(worker.idle)
            metrics = httpx.get(s.url + "/metrics").text
            assert "batchspec_engine_errors_total 1.0" in metrics


def test_health_models_metrics(server):
    client = _client(server.url)
    client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=6, temperature=0)
    models = client.models.list()
    assert [m.id for m in models] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 256
    with httpx.Client(base_url=server.url) as http:
        h = http.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        m = http.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("batchspec_http_requests_total", "batchspec_queue_length", "batchspec_running_rows",
                 "batchspec_generated_tokens_total", "batchspec_rounds_total", "batchspec_mean_accepted_length",
                 "batchspec_time_to_first_token_seconds_bucket", "batchspec_time_per_output_token_seconds_count",
                 "batchspec_e2e_request_latency_seconds_sum", "batchspec_prompt_tokens_total",
                 "batchspec_requests_finished_total", "batchspec_engine_alive 1.0"):
        assert name in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["batchspec_generated_tokens_total"] >= 6 and values["batchspec_rounds_total"] >= 1
    assert values["batchspec_mean_accepted_length"] >= 1.0
    assert values['batchspec_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["batchspec_e2e_request_latency_seconds_count"] >= 1


# ------------------------------------------------------------------------------------------------ units


class _CharTokenizer:
    """Each id is one character; id 9 is half of a two-token character (decodes to U+FFFD unless 10 follows)."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 9:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == 10 else "\ufffd")
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 10 else 1
            else:
                out.append("abcdefgh"[ids[i]])
                i += 1
        return "".join(out)


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    ts = TextStream(_CharTokenizer(), stop=["cde"])
    assert ts.add([0, 1]) == ([0, 1], "ab")
    assert ts.add([2]) == ([2], "")  # "c" may start the stop string
    assert ts.add([3]) == ([3], "")  # "cd" too
    assert ts.add([0]) == ([0], "cda")  # "cda" does not
    assert ts.add([9]) == ([9], "")  # half a character
    assert ts.add([10, 2, 3, 4, 5]) == ([10, 2, 3, 4], "é")  # stops at the token that completes "cde"
    assert ts.stopped == "cde" and ts.flush() == "" and ts.text == "abcdaé"
    assert ts.add([1]) == ([], "")
    plain = TextStream(_CharTokenizer())
    assert plain.add([0, 9]) == ([0, 9], "a") and plain.flush() == "\ufffd"
    none = TextStream(None, ())
    assert none.add([1, 2]) == ([1, 2], "") and none.ids == [1, 2]


# ------------------------------------------------------------------------------------------------ command line


def test_serve_command(tmp_path):
    """``python -m batchspec serve`` on a model directory: a real process, health, a greedy request, shutdown."""
    proc, url = servekit.serve_command(["--target", str(servekit.model_dir(tmp_path)), "--batch-size", "2",
                                        "--served-model-name", "m", "--api-key", "k", "--log-level", "warning"])
    try:
        r = _client(url, "k").completions.create(model="m", prompt=PROMPTS[2], max_tokens=7, temperature=0,
                                                 extra_body={"return_token_ids": True})
        assert _extra(r.choices[0], "token_ids") == tiny.oracle(tiny.target(), PROMPTS[2], 7)
    finally:
        servekit.stop(proc)
    assert proc.returncode == 0  # an idle server winds down at once


def test_sigterm_lets_requests_finish_then_ends_the_rest(tmp_path):
    """SIGTERM with requests in flight (no draft, steps of at least 0.1 s: one token each): new requests get a JSON
    503 and ``/health`` says so; a short stream finishes within the 4 s grace period; past it a long stream gets an
    error event then ``[DONE]``, a long non-streamed request a JSON 503; no traceback, exit status 0."""
    import signal

    proc, url = servekit.serve_command(["--target", str(servekit.model_dir(tmp_path)), "--batch-size", "4",
                                        "--served-model-name", MODEL, "--shutdown-grace", "4",
                                        "--log-level", "warning"], slow=0.1)
    try:
        with httpx.Client(base_url=url, timeout=30) as http, ThreadPoolExecutor(1) as pool:
            plain = pool.submit(http.post, "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[1],
                                                                    "max_tokens": 150, "temperature": 0})
            long = _open_stream(http, PROMPTS[2], 150)
            short = _open_stream(http, PROMPTS[3], 15)
            first = json.loads(next(line for line in short[2] if line.startswith("data:"))[5:])
            assert _wait(lambda: "batchspec_requests_in_flight 3.0" in http.get("/metrics").text)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            assert _wait(lambda: http.get("/health").status_code == 503)
            err = _check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [3], "max_tokens": 2}),
                               503)
            assert err["code"] == "shutting_down"
            ids = first["choices"][0]["token_ids"] + _stream_ids(short[2])
            assert ids == tiny.oracle(tiny.target(), PROMPTS[3], 15) and time.monotonic() - t0 < 4
            events = [line for line in long[2] if line.startswith("data:")]
            assert events[-1] == "data: [DONE]" and time.monotonic() - t0 > 3.9
            assert json.loads(events[-2][5:])["error"]["code"] == "shutting_down"
            assert all("choices" in json.loads(e[5:]) for e in events[:-2])
            assert _check_error(plain.result(), 503)["code"] == "shutting_down"
            for cm, _, _ in (long, short):
                cm.__exit__(None, None, None)
        proc.wait(30)
        assert time.monotonic() - t0 < 15
    finally:
        out = servekit.stop(proc, signal.SIGKILL)
    assert proc.returncode == 0 and "Traceback" not in out, out


def test_serve_command_reports_bad_flags(capsys):
    from batchspec.cli import main

    assert main(["serve", "--target", "/nonexistent/model"]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize("flags, budget", [([], PREFILL_TOKENS), (["--max-prefill-tokens", "0"], None),
                                           (["--max-prefill-tokens", "512"], 512)])
def test_serve_bounds_the_tokens_a_step_prefills_by_default(monkeypatch, flags, budget):
    """``batchspec serve`` hands the app its step's prefill budget: ``PREFILL_TOKENS`` unless told (0: none)."""
    import batchspec
    from batchspec.cli import serve as serve_cli
    from batchspec.cli.commands import build_parser

    got = {}
    monkeypatch.setattr(batchspec.LLM, "from_config", classmethod(lambda cls, cfg: None))
    monkeypatch.setattr("batchspec.serve.app.create_app", lambda llm, **kw: got.update(kw))
    serve_cli.build_app(build_parser().parse_args(["serve", *flags]))
    assert got["prefill_tokens"] == budget


def test_a_second_shutdown_ends_the_grace_period_at_once():
    """``app.state.shutdown`` twice (a second signal): the long grace period ends at once, the stream in flight gets
    its error event and ``[DONE]``, then the server is told to stop; a non-streamed request meanwhile gets a JSON
    503."""
    app = create_app(_llm(), model_name=MODEL)
    stopped = threading.Event()
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        _slow(app.state.worker, 0.05)
        cm, _, lines = _open_stream(http, PROMPTS[1], 200)
        assert next(line for line in lines if line.startswith("data:"))
        app.state.shutdown(600, stopped.set)
        assert _wait(lambda: http.get("/health").status_code == 503)
        assert _check_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [3]}), 503)["code"] == (
            "shutting_down")
        assert not stopped.is_set()
        app.state.shutdown(600, stopped.set)
        events = [line for line in lines if line.startswith("data:")]
        cm.__exit__(None, None, None)
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][5:])["error"]["code"] == "shutting_down"
        assert stopped.wait(10)


def test_an_empty_api_key_is_refused(monkeypatch, capsys):
    """An empty key (flag or environment) would turn on a check that an empty token passes: a one-line error before
    the model loads (the target here does not exist), exit status 2; ``create_app`` refuses it too."""
    from batchspec.cli import main

    assert main(["serve", "--target", "/nonexistent/model", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert "API key" in err and "empty" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("BATCHSPEC_API_KEY", " ")
    assert main(["serve", "--target", "/nonexistent/model"]) == 2
    assert "empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        create_app(_llm(), api_key="")
