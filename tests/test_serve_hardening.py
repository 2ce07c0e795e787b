"""The server against hostile or careless input, through real HTTP (and the official ``openai`` client where it
fits): numbers out of range are a 400 naming the field and never reach the engine (a stream running beside them stays
exact), oversize bodies are a 413 before they are read, tokenising runs off the event loop, client mistakes are 400s
without internals, internal failures a generic 500 with a request id that the log has, and browsers of other sites
cannot drive the server (content type, Host, Origin; no docs pages)."""

import asyncio
import json
import logging
import threading
import time

import httpx
import openai
import pytest
import servekit
import tiny

from batchspec.serve import protocol as P
from batchspec.serve.app import create_app
from batchspec.serve.guard import Guard, host_name
from batchspec.serve.server import ServerThread

MODEL = "tiny"
PROMPTS = tiny.prompts(8, seed=11, lo=3, hi=30)
CONTEXT = 256  # the tiny target's
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(servekit.llm(), model_name=MODEL)) as s:
        yield s


def _error(r, status, param="unset"):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param != "unset":
        assert err["param"] == param, err
    return err


def _post(http, path, raw: bytes, **kw):
    return http.post(path, content=raw, headers={**JSON, **kw.pop("headers", {})}, **kw)


def _ids(event):
    return event["choices"][0].get("token_ids") or []


# ------------------------------------------------------------------------------------------------ 1: numbers

# raw JSON (Infinity and NaN are what Python's json module writes and reads), the parameter the 400 must name
BAD_NUMBERS = [
    ('"top_k": 9223372036854775808', "top_k"),  # 2**63: passed validation and failed the engine step
    ('"top_k": 1e30', "top_k"),
    ('"top_k": 1000000000000000000000000000000', "top_k"),
    ('"top_k": 2147483648', "top_k"),
    ('"top_k": -2', "top_k"),
    ('"temperature": Infinity', "temperature"),
    ('"temperature": -Infinity', "temperature"),
    ('"temperature": NaN', "temperature"),
    ('"temperature": 1e308', "temperature"),
    ('"temperature": 1e400', "temperature"),  # parses as infinity
    ('"temperature": 10000.5', "temperature"),
    ('"top_p": 0', "top_p"),
    ('"top_p": 2', "top_p"),
    ('"top_p": NaN', "top_p"),
    ('"top_p": Infinity', "top_p"),
    ('"seed": 18446744073709551616', "seed"),
    ('"seed": -9223372036854775809', "seed"),
    ('"max_tokens": 9223372036854775808', "max_tokens"),
    ('"max_tokens": 1e300', "max_tokens"),
    ('"max_tokens": Infinity', "max_tokens"),
    ('"stop_token_ids": [9223372036854775808]', "stop_token_ids"),
    ('"max_tokens": "' + "9" * 100_000 + '"', "max_tokens"),  # echoed in the message: cut short
]


def test_bad_numbers_get_400_and_a_running_stream_stays_exact():
    """A greedy stream is running (each round slowed down) while every bad number arrives, on both endpoints: each
    gets a 400 naming its field, nothing reaches the engine (no failed step, no restart) and the stream's tokens are
    the batch-size-1 oracle's."""
    app = create_app(servekit.llm(), model_name=MODEL)
    worker = app.state.worker
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        servekit.slow(worker, 0.02)
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "stream": True,
                "return_token_ids": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = [json.loads(next(x for x in lines if x.startswith("data:"))[5:])]  # running now
            for field, param in BAD_NUMBERS:
                raw = ('{"model": "tiny", "prompt": [1, 2, 3], ' + field + "}").encode()
                err = _error(_post(http, "/v1/completions", raw), 400, param)
                assert len(err["message"]) < 400 and "Error" not in err["message"], err
                chat = ('{"model": "tiny", "messages": [{"role": "user", "content": "w4 w5"}], ' + field + "}")
                _error(_post(http, "/v1/chat/completions", chat.encode()), 400,
                       "max_tokens" if param == "max_tokens" else param)
            client = servekit.client(s.url)
            with pytest.raises(openai.BadRequestError) as e:  # the repro, through the official client
                client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=2, temperature=0,
                                          extra_body={"top_k": 2**63})
            assert e.value.body["param"] == "top_k"
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=2, temperature=1e308)
            assert e.value.body["param"] == "temperature"
            for line in lines:
                data = P.sse_data(line)
                if data is None or data == P.DONE:
                    continue
                events.append(data)
        assert "error" not in events[-1], events[-1]
        assert [t for ev in events for t in _ids(ev)] == tiny.oracle(tiny.target(), PROMPTS[0], 48)
        assert worker.errors == 0 and worker.restarts == 0 and worker.finished["error"] == 0
        assert "batchspec_engine_errors_total 0.0" in http.get("/metrics").text


def test_top_k_above_the_vocabulary_keeps_every_token(server):
    """top_k between the vocabulary and 2**31 is accepted and filters nothing (same draws as top_k 0)."""
    client = servekit.client(server.url)

    def call(top_k):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0.8, seed=7,
                                      extra_body={"top_k": top_k, "return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    assert call(2**31 - 1) == call(10 * tiny.VOCAB) == call(0) == call(-1)


# ------------------------------------------------------------------------------------------------ 2: sizes


def test_20mb_body_is_refused_quickly_while_health_answers(server, capsys):
    """A 20 MB body gets 413 (with and without Content-Length) and /health keeps answering meanwhile."""
    big = b'{"model": "tiny", "prompt": "' + b"w5 " * (20 * 2**20 // 3) + b'"}'
    results, latencies, done = {}, [], threading.Event()

    def upload():
        with httpx.Client(base_url=server.url, timeout=60) as http:
            t0 = time.perf_counter()
            results["length"] = (_post(http, "/v1/completions", big), time.perf_counter() - t0)
            chunks = (big[i : i + 2**16] for i in range(0, len(big), 2**16))  # chunked: no Content-Length
            t0 = time.perf_counter()
            results["chunked"] = (http.post("/v1/completions", content=chunks, headers=JSON),
                                  time.perf_counter() - t0)
        done.set()

    t = threading.Thread(target=upload)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        t.start()
        while not done.is_set():
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    t.join()
    for kind in ("length", "chunked"):
        r, seconds = results[kind]
        err = _error(r, 413)
        assert err["code"] == "request_too_large" and str(P.DEFAULT_MAX_BODY_BYTES) in err["message"]
        assert seconds < 5, (kind, seconds)
    assert latencies and max(latencies) < 5
    with capsys.disabled():
        print(f"\n20 MB body: 413 in {results['length'][1]:.3f} s (Content-Length), {results['chunked'][1]:.3f} s "
              f"(chunked); /health answered {len(latencies)} times meanwhile, slowest {max(latencies):.3f} s")


def test_body_limit_is_configurable():
    app = create_app(servekit.llm(), model_name=MODEL, max_body_bytes=200)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        ok = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
        assert http.post("/v1/completions", json=ok).status_code == 200
        _error(http.post("/v1/completions", json={**ok, "prompt": [5] * 100}), 413)
    with pytest.raises(ValueError, match="max_body_bytes"):
        create_app(servekit.llm(), max_body_bytes=0)


class _CountingTokenizer:
    """The test tokenizer, counting (and optionally slowing) every call that tokenises or renders a template."""

    def __init__(self, tok, delay=0.0):
        self.tok, self.delay, self.calls = tok, delay, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        time.sleep(self.delay)
        return self.tok(*a, **kw)

    def apply_chat_template(self, *a, **kw):
        self.calls += 1
        time.sleep(self.delay)
        return self.tok.apply_chat_template(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_prompt_length_is_checked_before_tokenising(server):
    info = server.app.state.info
    counting = _CountingTokenizer(info.tokenizer)
    info.tokenizer = counting
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            text = "w5" * (CONTEXT * P.MAX_CHARS_PER_TOKEN // 2 + 1)
            err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": text}), 400, "prompt")
            assert err["code"] == "context_length_exceeded"
            msgs = [{"role": "user", "content": text[: len(text) // 2]}, {"role": "user", "content": text}]
            err = _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs}), 400, "messages")
            assert err["code"] == "context_length_exceeded"
            assert counting.calls == 0  # refused before any tokenising
            err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 300_000}), 400, "prompt")
            assert err["code"] == "context_length_exceeded"
            # a text that passes the character check but tokenises beyond the context: refused after tokenising
            err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "w5 " * 300}), 400, "prompt")
            assert err["code"] == "context_length_exceeded" and counting.calls == 1
    finally:
        info.tokenizer = counting.tok


def test_tokenising_runs_off_the_event_loop(server):
    """While a (deliberately slow) tokenizer works on one request, /health and other requests are answered."""
    info = server.app.state.info
    slow = _CountingTokenizer(info.tokenizer, delay=2.0)
    info.tokenizer = slow
    out = {}
    try:
        def chat():
            out["chat"] = servekit.client(server.url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "w7 w8"}], max_tokens=3, temperature=0)

        t = threading.Thread(target=chat)
        t.start()
        assert servekit.wait(lambda: slow.calls == 1)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 2,
                                                   "temperature": 0})
            seconds = time.perf_counter() - t0
        assert r.status_code == 200 and seconds < 1.5, seconds
        assert t.is_alive()  # still tokenising
        t.join(30)
        assert out["chat"].usage.completion_tokens == 3
    finally:
        info.tokenizer = slow.tok


# ------------------------------------------------------------------------------------------------ 3: no internals


def test_client_mistakes_are_400_without_internals(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        nested = b"[" * 100_000 + b"]" * 100_000
        err = _error(_post(http, "/v1/completions", nested), 400)
        assert "nested too deeply" in err["message"]
        nested_obj = b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        _error(_post(http, "/v1/chat/completions", nested_obj), 400)
        cases = [
            ("/v1/completions", rb'{"model": "tiny", "prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
            ("/v1/completions", rb'{"model": "tiny", "prompt": ["w5 \udfff"], "max_tokens": 2}', "prompt"),
            ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": "a\ud800b"}]}',
             "messages[0].content"),
            ("/v1/chat/completions", rb'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text",'
                                     rb' "text": "\ud800"}]}]}', "messages[0].content"),
            ("/v1/completions", rb'{"model": "tiny", "prompt": "w5", "stop": ["\ud800"]}', "stop"),
            ("/v1/completions", rb'{"model": "tiny", "prompt": "w5", "stop": ["' + b"x" * 300 + rb'"]}', "stop"),
            ("/v1/completions", rb'{"model": "ti\ud800ny", "prompt": "w5"}', "model"),
            ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "seed": 1' + b"0" * 5000 + b"}", None),
            ("/v1/completions", b'\xff\xfe{"model"', None),
        ]
        for path, raw, param in cases:
            err = _error(_post(http, path, raw), 400, param)
            for leak in ("TypeError", "TextEncodeInput", "RecursionError", "Traceback", "Union["):
                assert leak not in err["message"], err
        assert "lone surrogate" in _error(_post(http, *cases[0][:2]), 400)["message"]
    assert server.app.state.worker.alive


def test_chat_template_errors_keep_the_templates_words_only(server):
    tok = server.app.state.info.tokenizer
    saved = tok.chat_template
    tok.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    try:
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "w4"}]})
        assert "roles must alternate" in _error(r, 400, "messages")["message"]
        tok.chat_template = "{{ messages[0]['content'] + 5 }}"  # a broken template: no Python error text goes out
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "w4"}]})
        assert _error(r, 400, "messages")["message"] == "the chat template cannot render these messages"
    finally:
        tok.chat_template = saved


def test_internal_failures_are_a_generic_500_with_a_logged_request_id(caplog, monkeypatch):
    """A bug (here: injected) answers 500 'internal error, request id <id>', never its text; the log has the id with
    the exception. In a stream whose headers went out, the same message comes as an error event."""
    llm = servekit.llm()
    app = create_app(llm, model_name=MODEL)
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        caplog.set_level(logging.ERROR, logger="batchspec.serve")

        def broken(*a, **kw):
            raise RuntimeError("secret detail /home/me/model")

        monkeypatch.setattr(llm, "requests", broken)
        err = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6]}), 500)
        assert err["message"].startswith("internal error, request id req-") and "secret" not in err["message"]
        rid = err["message"].rsplit(" ", 1)[1]
        assert any(rid in r.getMessage() and r.exc_info and "secret detail" in str(r.exc_info[1])
                   for r in caplog.records)
        monkeypatch.undo()

        real_chunk = P.chunk

        def failing_chunk(req, rid, created, text, ids, finish_reason=None, first=False, use=None):
            if not first:
                raise KeyError("secret chunk detail")
            return real_chunk(req, rid, created, text, ids, finish_reason, first, use)

        monkeypatch.setattr(P, "chunk", failing_chunk)
        with pytest.raises(openai.APIError) as e:
            list(servekit.client(s.url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "w4"}], max_tokens=4, temperature=0, stream=True))
        assert "internal error, request id chatcmpl-" in str(e.value) and "secret" not in str(e.value)
        rid = str(e.value).rsplit(" ", 1)[1].strip("'\"")
        assert any(rid in r.getMessage() and r.exc_info for r in caplog.records), rid
        monkeypatch.undo()
        assert servekit.wait(app.state.worker.idle)


# ------------------------------------------------------------------------------------------------ 4: browsers


def test_only_json_bodies(server):
    body = json.dumps({"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            r = http.post("/v1/completions", content=body, headers={"content-type": ctype} if ctype else {})
            assert _error(r, 415)["code"] == "unsupported_media_type"
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
        _error(r, 415)
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            assert http.post("/v1/completions", content=body, headers={"content-type": ctype}).status_code == 200


def test_host_and_origin_checks(server):
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    port = server.port
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "localhost.evil", "[::2]"):
            assert _error(http.get("/health", headers={"host": host}), 400)["code"] == "invalid_host"
            _error(http.post("/v1/completions", json=body, headers={"host": host}), 400)
        for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", "[::1]", "[::1]:1",
                     "LOCALHOST.", "localhost:80"):
            assert http.get("/health", headers={"host": host}).status_code == 200, host
        for origin in ("https://evil.example", "http://localhost:3000", "null", f"http://localhost:{port}"):
            r = http.post("/v1/completions", json=body, headers={"origin": origin})  # Host is 127.0.0.1:port
            assert _error(r, 403)["code"] == "forbidden_origin", origin
        assert http.post("/v1/completions", json=body, headers={"origin": server.url}).status_code == 200
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 404


def test_allowed_hosts_and_origins_and_docs():
    app = create_app(servekit.llm(), model_name=MODEL, allowed_hosts=["my.host", "Other.Host:99"],
                     allowed_origins=["http://localhost:3000"], docs=True, api_key="k")
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
    auth = {"authorization": "Bearer k"}
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        for host in ("my.host", "my.host:8000", "other.host", "localhost"):
            assert http.get("/health", headers={"host": host}).status_code == 200, host
        _error(http.get("/health", headers={"host": "evil.example"}), 400)
        r = http.post("/v1/completions", json=body, headers={"origin": "http://localhost:3000", **auth})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        pre = http.options("/v1/completions", headers={"origin": "http://localhost:3000",
                                                        "access-control-request-method": "POST",
                                                        "access-control-request-headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        _error(http.post("/v1/completions", json=body, headers={"origin": "http://localhost:3001", **auth}), 403)
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 200
    app = create_app(servekit.llm(), model_name=MODEL, allowed_hosts=["*"], allowed_origins=["*"])
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        r = http.post("/v1/completions", json=body, headers={"host": "anything.example", "origin": "https://x.y"})
        assert r.status_code == 200


def test_guard_checks_host_on_loopback_connections_only():
    """Unit: a connection that arrived on a LAN address is not Host-checked unless allowed hosts are given."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def status(guard, server, host):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": "/health", "scheme": "http", "server": server,
                 "headers": [(b"host", host.encode())]}
        asyncio.run(guard(scope, None, send))
        return sent[0]["status"]

    plain = Guard(app)
    assert status(plain, ("127.0.0.1", 8000), "evil.example") == 400
    assert status(plain, ("::ffff:127.0.0.1", 8000), "evil.example") == 400
    assert status(plain, ("::1", 8000), "evil.example") == 400
    assert status(plain, ("192.168.1.5", 8000), "evil.example") == 200
    assert status(plain, ("192.168.1.5", 8000), "192.168.1.5:8000") == 200
    listed = Guard(app, allowed_hosts=["box.lan"])
    assert status(listed, ("192.168.1.5", 8000), "evil.example") == 400
    assert status(listed, ("192.168.1.5", 8000), "box.lan:8000") == 200
    assert [host_name(h) for h in ("A.b:80", "[::1]:9", "x:y", "[::1", "", "h.")] == ["a.b", "::1", None, None,
                                                                                        None, "h"]


def test_serve_flags(monkeypatch, capsys):
    from batchspec.cli.commands import build_parser

    monkeypatch.setenv("BATCHSPEC_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--allowed-hosts", "a.lan,b.lan", "--allowed-hosts", "c",
                                      "--allowed-origins", "http://localhost:3000", "--max-body-bytes", "1000"])
    assert args.api_key == "from-env" and args.allowed_hosts == ["a.lan", "b.lan", "c"]
    assert args.allowed_origins == ["http://localhost:3000"] and args.max_body_bytes == 1000 and not args.docs
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "BATCHSPEC_API_KEY" in text and "ps" in text and "--max-body-bytes" in text and "--docs" in text


def test_worker_refuses_a_bad_engine_request_alone():
    """Below the HTTP validation: a request handed straight to the engine thread that the batch could not run fails
    alone (a generic error event; nothing else restarts) and the request running beside it stays exact."""
    from batchspec.engine.engine import Request
    from batchspec.serve.worker import EngineWorker

    llm = servekit.llm()
    worker = EngineWorker(llm).start()
    try:
        events = {"good": [], "bad": []}
        done = {k: threading.Event() for k in events}

        def deliver(name):
            def f(ev):
                events[name].append(ev)
                if ev[0] != "tokens":
                    done[name].set()
            return f

        servekit.slow(worker, 0.01)
        _, (good,) = llm.requests([PROMPTS[2]], servekit.batchspec.SamplingParams(max_tokens=30))
        worker.submit(good, deliver("good"), name="good-1")
        assert servekit.wait(lambda: events["good"])  # running
        worker.submit(Request([1, 2], 4, set(), 0.5, 2**63, 1.0, 0), deliver("bad"), name="bad-1")
        assert done["bad"].wait(10) and done["good"].wait(30)
        assert events["bad"] == [("error", "internal error, request id bad-1")]
        assert [t for ev in events["good"] if ev[0] == "tokens" for t in ev[1]] == tiny.oracle(
            tiny.target(), PROMPTS[2], 30)
        assert worker.errors == 0 and worker.restarts == 0
    finally:
        worker.stop()
