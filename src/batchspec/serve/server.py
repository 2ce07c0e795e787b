"""Run a server app with uvicorn: in the foreground (``serve_forever``, the ``batchspec serve`` command) or in a
background thread (``ServerThread``: tests, notebooks, the endpoint audit of a local model)."""

from __future__ import annotations

import socket
import threading
import time


def _config(app, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                          access_log=log_level in ("debug", "trace"))


def serve_forever(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  grace: float = 30.0) -> None:
    """Serve until SIGTERM or SIGINT, then wind down (``graceful``) and return."""
    import uvicorn

    server = uvicorn.Server(_config(app, host, port, log_level))
    graceful(server, app, grace)
    server.run()


def graceful(server, app, grace: float) -> None:
    """Make ``server``'s SIGTERM and SIGINT wind ``app`` down before it stops (``app.state.shutdown``: no new requests,
    up to ``grace`` seconds for those in flight, the rest ended with an error) instead of cutting its streams; a
    second signal ends the grace period at once. The signal is not raised again afterwards: the exit is a clean one."""
    shutdown = getattr(app.state, "shutdown", None)
    if shutdown is None:
        return

    def stop() -> None:
        server.should_exit = True

    def handle_exit(sig, frame) -> None:
        shutdown(grace, stop)

    server.handle_exit = handle_exit


class ServerThread:
    """``with ServerThread(app) as s: ... s.url ...``: uvicorn on ``host`` and a free port (or ``port``) in a daemon
    thread; ``stop()`` (or leaving the ``with`` block) shuts it down, the app's engine thread with it."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app, self.host, self.log_level = app, host, log_level
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.server = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        import uvicorn

        self.server = uvicorn.Server(_config(self.app, self.host, self.port, self.log_level))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"uvicorn-{self.port}")
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} did not start")
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise RuntimeError(f"the server on {self.url} did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
