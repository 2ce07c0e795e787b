"""What keeps a web page in a browser from driving the server: an ASGI middleware that checks the ``Host`` header
(DNS rebinding: a page whose name resolves to 127.0.0.1 talks to a loopback server as its own origin) and the
``Origin`` header (a page of another site posting to the server).

- ``Host``: on a connection that arrives on a loopback address (and on every connection once ``allowed_hosts`` is
  given) the request must name ``localhost``, ``127.0.0.1``, ``[::1]`` or a name of ``allowed_hosts``, any port
  (``"*"``: any name). A request without ``Host`` (HTTP/1.0; browsers always send one) passes. Otherwise: 400.
- ``Origin``: a request that carries one must come from the server's own origin (``scheme://Host``) or one of
  ``allowed_origins`` (``"*"``: any). Otherwise: 403. Browsers send ``Origin`` with every cross-site POST, also the
  "simple" ``text/plain`` ones that need no preflight; ``curl`` and SDK clients send none.
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_PORTS = {"http": 80, "https": 443}


def host_name(value: str) -> str | None:
    """The name in a ``Host`` header (lower case, without port, brackets or a trailing dot); None when malformed."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        name, rest = (v[1:end], v[end + 1 :]) if end > 0 else ("", "")
    else:
        name, colon, port = v.partition(":")
        rest = colon + port
    if not name or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
        return None
    return name.rstrip(".") or None


def is_loopback(address) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def origin_key(origin: str, default_scheme: str = "http") -> tuple | None:
    """``(scheme, host, port)`` of an origin (``http://localhost:3000``), ports filled in; None when malformed."""
    try:
        u = urlsplit(origin.strip().lower())
        port = u.port
    except ValueError:
        return None
    scheme = u.scheme or default_scheme
    if not u.hostname:
        return None
    return scheme, u.hostname.rstrip("."), port if port is not None else DEFAULT_PORTS.get(scheme)


class Guard:
    """ASGI middleware: the ``Host`` and ``Origin`` checks above. ``refused(path, status)`` is called for each
    refusal (metrics)."""

    def __init__(self, app, allowed_hosts=None, allowed_origins=(), refused=None):
        self.app, self.refused = app, refused
        self.check_every_host = bool(allowed_hosts)
        hosts = {h for h in (host_name(h) if h != "*" else "*" for h in (allowed_hosts or ())) if h}
        self.any_host = "*" in hosts
        self.hosts = hosts | set(LOOPBACK_HOSTS)
        origins = list(allowed_origins or ())
        self.any_origin = "*" in origins
        self.origins = {k for k in (origin_key(o) for o in origins if o != "*") if k}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or ():
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = headers.get("host")
        server = scope.get("server") or (None, None)
        if host is not None and not self.any_host and (self.check_every_host or is_loopback(server[0])):
            name = host_name(host)
            if name not in self.hosts:
                return await self._refuse(scope, send, 400, f"the Host header {host[:100]!r} is not a name of this "
                                          "server (add it with --allowed-hosts)", "invalid_host")
        origin = headers.get("origin")
        if origin is not None and not self.any_origin:
            key = origin_key(origin)
            scheme = scope.get("scheme", "http")
            own = origin_key(f"{scheme}://{host}") if host else None
            if key is None or (key != own and key not in self.origins):
                return await self._refuse(scope, send, 403, f"requests from the web origin {origin[:100]!r} are "
                                          "not allowed (add it with --allowed-origins)", "forbidden_origin")
        return await self.app(scope, receive, send)

    async def _refuse(self, scope, send, status: int, message: str, code: str) -> None:
        if self.refused is not None:
            self.refused(scope.get("path", ""), status)
        kind = "invalid_request_error" if status == 400 else "permission_error"
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}},
                          separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
