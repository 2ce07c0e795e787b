"""The C kernels' plumbing (``batchspec.model.kernels``): their ctypes declarations against the C definitions, the
build's cache key and its compiler output kept off the terminal, and kernels that cannot be built told once while
every output stays exact."""

from __future__ import annotations

import logging
import os
import re
import shutil

import pytest
import torch

import batchspec
from batchspec import SamplingParams
from batchspec.model import kernels
from batchspec.model import weights as W
from batchspec.model.loading import load_model

import tiny
from test_weights import quantised_target

LOADED = kernels.library()  # as this process built it, before any test rebuilds it
built = pytest.mark.skipif(LOADED is None, reason="the C kernels are not built here")
C_SOURCES = "".join(p.read_text() for p in kernels._SOURCES)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The kernels as in a new process (not built or tried yet), with their cache in a folder of their own."""
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BATCHSPEC_KERNELS", raising=False)
    for name, value in (("_lib", None), ("_tried", False), ("_off", None), ("_told", False)):
        monkeypatch.setattr(kernels, name, value)
    return tmp_path


def skinny(lib, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0])
    lib.skinny_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0], x.shape[1])
    return y


def kernel_records(caplog):
    return [r for r in caplog.records if r.name == "batchspec.kernels"]


@pytest.mark.parametrize("name", sorted(kernels.SIGNATURES))
def test_each_declaration_matches_its_c_definition(name):
    found = re.search(rf"^(void|int|long) {name}\(([^)]*)\)", C_SOURCES, re.M)
    assert found, name
    params = [p.strip() for p in found.group(2).split(",") if p.strip() not in ("", "void")]
    want = [(re.findall(r"\w+", p)[-1], "ptr" if "*" in p else p.split()[0]) for p in params]
    restype, args = kernels.signature(name)
    assert restype is kernels._C_TYPES[found.group(1)]
    assert args == [(arg, kernels._C_TYPES[kind]) for arg, kind in want]


def test_the_cache_key_covers_every_header(monkeypatch, tmp_path):
    copy = tmp_path / "kernels"
    shutil.copytree(kernels._DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(kernels, "_DIR", copy)
    monkeypatch.setattr(kernels, "_SOURCES", [copy / p.name for p in kernels._SOURCES])
    before = kernels.source_digest()
    assert (copy / "reduce.h").is_file() and (copy / "packed.h").is_file()
    with open(copy / "reduce.h", "a") as f:
        f.write("/* edited */\n")
    edited = kernels.source_digest()
    assert edited != before
    (copy / "extra.h").write_text("/* a header added */\n")
    assert kernels.source_digest() not in (before, edited)


@built
def test_the_build_writes_the_compilers_output_to_its_log_not_the_terminal(fresh, monkeypatch, capfd):
    cc = fresh / "cc"  # the system compiler, with notes on both streams as gcc prints them
    real = shutil.which("cc") or shutil.which("gcc")
    cc.write_text(f'#!/bin/sh\necho "note: on stderr" >&2\necho "note: on stdout"\nexec {real} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    capfd.readouterr()
    lib = kernels.library()
    out, err = capfd.readouterr()
    assert lib is not None and (out, err) == ("", "")
    log = kernels.cache_dir() / f"cpu-{kernels.source_digest()}.log"
    assert str(kernels.cache_dir()).startswith(str(fresh)) and "note: on stderr" in log.read_text()
    assert "note: on stdout" in log.read_text()
    x, w = torch.randn(3, 75), torch.randn(40, 75)  # the fresh build gives the bits of the one loaded before
    assert torch.equal(skinny(lib, x, w).view(torch.int32), skinny(LOADED, x, w).view(torch.int32))


def test_a_broken_compiler_is_one_log_line_and_weights_stay_fp32_with_exact_outputs(fresh, monkeypatch, caplog,
                                                                                    capfd):
    path, _ = quantised_target(fresh)  # every linear weight packs where the kernels are built
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    caplog.set_level(logging.INFO, logger="batchspec")
    capfd.readouterr()
    assert kernels.library() is None  # the build fails: nothing of it on the terminal
    assert capfd.readouterr() == ("", "")
    models = [load_model(path, weights="auto") for _ in range(2)]
    records = kernel_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    log = kernels.cache_dir() / f"cpu-{kernels.source_digest()}.log"
    message = records[0].getMessage()
    assert message.startswith("packed weights and fused kernels off: the C kernels did not build")
    assert "install a C compiler" in message and str(log) in message and log.is_file()
    assert not any("kept in fp32" in r.getMessage() for r in caplog.records)
    assert all(W.report(m).formats == {} for m in models)
    prompts, sp = tiny.prompts(4, seed=5), SamplingParams(max_tokens=12)
    got = [o.token_ids for o in batchspec.LLM(models[0], batch_size=2).generate(prompts, sp)]
    assert got == [tiny.oracle(models[1], p, 12) for p in prompts]


@pytest.mark.parametrize("why", ["BATCHSPEC_KERNELS=0", "no AVX2"])
def test_weights_auto_tells_once_why_nothing_is_packed(fresh, monkeypatch, caplog, why):
    path, _ = quantised_target(fresh)
    if why == "no AVX2":
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    else:
        monkeypatch.setenv("BATCHSPEC_KERNELS", "0")
    caplog.set_level(logging.INFO, logger="batchspec")
    for _ in range(2):
        assert W.report(load_model(path, weights="auto")).formats == {}
    reason = "this CPU has no AVX2 (torch reports DEFAULT)" if why == "no AVX2" else why
    assert [r.getMessage() for r in kernel_records(caplog)] == [f"packed weights and fused kernels off: {reason}"]
    assert not os.path.exists(kernels.cache_dir())  # nothing was compiled
