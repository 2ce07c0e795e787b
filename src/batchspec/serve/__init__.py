"""Serving: an OpenAI-compatible HTTP server over one continuously batched engine (``app.create_app``), a background
server for tests and notebooks (``server.ServerThread``), and a load generator for any OpenAI-compatible endpoint
(``loadtest``). Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client, httpx); ``worker`` and ``protocol``
import without it."""
