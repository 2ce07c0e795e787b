"""Shared pieces of the serving tests: a tiny tokenizer, tiny LLMs for a server, an OpenAI client, waiting, and the
plumbing of fake servers on loopback."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import tiny

import batchspec


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("w0".."w95", "w0" doubling as the unknown token, so every id
    has one spelling and decoding is deterministic), with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(tiny.VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")
    fast.chat_template = ("{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
                          "{% if add_generation_prompt %}w3{% endif %}")
    return fast


def llm(**kw):
    """The tiny target with its draft (ragged acceptance), continuous batching, 4 rows by default."""
    kw.setdefault("num_draft_tokens", 3)
    kw.setdefault("batch_size", 4)
    kw.setdefault("tokenizer", tokenizer())
    return batchspec.LLM(tiny.target(), draft=tiny.draft(), scheduler="continuous", **kw)


def served(engine=None):
    """A ``batchspec serve`` app over ``engine`` (default ``llm()``) on loopback, as a context manager (``.url``)."""
    from batchspec.serve.app import create_app
    from batchspec.serve.server import ServerThread

    return ServerThread(create_app(engine if engine is not None else llm(), model_name="tiny"))


def model_dir(tmp_path):
    """The tiny target and its tokenizer saved in ``tmp_path/model``, for the ``serve`` command."""
    path = tmp_path / "model"
    tiny.target().save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


_SERVE = """
import sys
sys.path.insert(0, {tests!r})
import servekit
from batchspec.cli.commands import main
from batchspec.serve import app, worker


class Slowed(worker.EngineWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        servekit.slow(self, {slow!r})


app.EngineWorker = Slowed
sys.exit(main(sys.argv[1:]))
"""


def serve_command(args, slow=0.0, timeout=120.0):
    """``batchspec serve ARGS`` in a process of its own on a free loopback port, each engine step made ``slow``
    seconds longer: ``(process, url)`` once ``/health`` answers (its stdout holds its output and errors)."""
    import os
    import socket
    import subprocess
    import sys

    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = _SERVE.format(tests=os.path.dirname(os.path.abspath(__file__)), slow=slow)
    cmd = [sys.executable, "-c", script, "serve", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up():
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait(up, timeout):
        stop(proc)
        raise AssertionError(f"the server did not start within {timeout} s")
    return proc, url


def stop(proc, sig=None, timeout=30.0) -> str:
    """Send ``sig`` (default SIGINT) to a ``serve_command`` process, wait for it (killing it after ``timeout``
    seconds) and return its output."""
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(sig or signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read()


def faulty(fault):
    """A server whose engine has the injected ``fault`` (fixed speculation length: drafts are verified every round)."""
    return served(llm(fault=fault, speculation="fixed"))


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def slow(worker, seconds):
    """Make every engine step take at least ``seconds`` longer (so a test can act while requests run)."""
    step = worker.engine._schedule

    def slowed():
        time.sleep(seconds)
        return step()

    worker.engine._schedule = slowed


def wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.01)
    return True


class FakeServer:
    """An HTTP server on loopback answering with ``handler`` (which reaches this object as ``self.server.fake``) in a
    daemon thread, while used as a context manager; ``release`` is set on exit, for handlers that hang until then."""

    def __init__(self, handler):
        self.release = threading.Event()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.http.fake = self
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.http.shutdown()
        self.http.server_close()


class JsonHandler(BaseHTTPRequestHandler):
    """A quiet request handler with ``send`` (bytes, any content type) and ``send_json``."""

    def log_message(self, *args):
        pass

    def send(self, status: int, data: bytes, kind: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_json(self, status: int, body):
        self.send(status, json.dumps(body).encode())
