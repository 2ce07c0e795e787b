import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)  # tiny models: threads only add contention


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    """Keep any on-disk cache (oracle outputs, converted models) out of the user's home during tests."""
    if "BATCHSPEC_CACHE" not in os.environ or os.environ.get("CI"):
        monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def good():
    """``batchspec serve`` on the tiny target with its draft, on loopback (one per test module)."""
    import servekit

    with servekit.served() as s:
        yield s


@pytest.fixture(scope="module")
def padding_bug():
    """The same server with a fault that shows only under concurrency: padding slots left visible."""
    import servekit

    with servekit.faulty("dsd-unmasked-padding") as s:
        yield s
