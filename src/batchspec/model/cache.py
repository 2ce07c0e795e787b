"""batchspec's cache folder, where converted models, packed weights, built kernels, cost profiles and oracle outputs
are kept."""

from __future__ import annotations

import os
from pathlib import Path


def cache_base() -> Path:
    """batchspec's cache folder: ``$BATCHSPEC_CACHE``, default ``~/.cache/batchspec``."""
    base = os.environ.get("BATCHSPEC_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "batchspec"
