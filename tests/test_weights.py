"""Packed weights (``batchspec.model.weights``): each weight kept in the narrowest format that holds its fp32 values
exactly. The oracle for the block formats is gguf's own quantiser and dequantiser (an independent implementation);
for outputs, the fp32 path of the same engine (bit for bit) and HF ``generate`` at batch size 1 (token for token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import quants

import batchspec
from batchspec import SamplingParams
from batchspec.model import kernels
from batchspec.model.loading import load_model
from batchspec.model import weights as W
from batchspec.model.kernels import llama as fused
from batchspec.model.runner import Runner

import tiny

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the C kernels are not built here")

GGUF = {"q4_0": GT.Q4_0, "q4_1": GT.Q4_1, "q8_0": GT.Q8_0}


def gguf_values(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` quantised and dequantised by gguf: fp32 values that ``kind`` holds exactly."""
    raw = quants.quantize(x.detach().float().numpy(), GGUF[kind])
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, GGUF[kind]))).float().view(x.shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gguf_blocks_are_found_and_expand_to_gguf_values(kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 192, generator=g) * 0.05
    x[3, :32] = 0.0  # a block of zeros
    x[5, 32:64] = 0.25  # a block of one value
    v = gguf_values(x, kind)
    p = W.pack(v)
    assert p is not None and p.kind == kind  # the narrowest format that holds the values
    assert torch.equal(bits(p.expand()), bits(v))  # the kernel's expansion
    assert torch.equal(bits(W.expand_torch(p)), bits(v))  # torch's, the same arithmetic
    ids = torch.tensor([[0, 39], [3, 5]])
    assert torch.equal(bits(p.rows(ids)), bits(v[ids]))
    assert p.nbytes / (4 * v.numel()) == pytest.approx(W.BITS[kind] / 32)


def test_narrowest_format_wins_and_others_stay_fp32():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 64, generator=g)
    assert W.pack(x.bfloat16().float()).kind == "bf16"
    assert W.pack(x.half().float()).kind == "f16"
    assert W.pack(x) is None  # no format holds random fp32 values
    v = gguf_values(x, "q4_1")
    v[7, 9] = torch.nextafter(v[7, 9], torch.tensor(1e9))  # one value an ulp off: no block format holds it
    assert W.pack(v) is None
    assert W.pack(x.double()) is None and W.pack(x[0]) is None  # only 2-D fp32 tensors are packed


@pytest.mark.parametrize("blocks", ["full", "avx512", "avx2"])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "bf16", "f16"])
def test_packed_linear_gives_the_fp32_kernels_bits(kind, blocks):
    """Packed against the fp32 kernel over the weights' values, bit for bit, at every block shape; where the CPU has
    AVX-512, the packed blocks of that kind (two weight rows a register; the 4-bit formats' lookups), those chosen for
    CPUs that run 512-bit operations as two halves and the 16-lane blocks at every row count (``full``, and no
    expansion once over many rows), against the fp32 kernel's AVX2 blocks."""
    lib = kernels.library()
    avx512 = blocks != "avx2"
    if avx512 and not lib.skinny_avx512(1):
        pytest.skip("this CPU has no AVX-512")
    was = lib.packed_full_width(-1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(77, 192, generator=g) * 0.1
    v = gguf_values(x, kind) if kind in GGUF else (x.bfloat16() if kind == "bf16" else x.half()).float()
    lin = W.PackedLinear(W.pack(v))
    assert lin.packed.kind == kind
    a = torch.randn(80, 192, generator=g)
    try:
        lib.skinny_avx512(int(avx512))
        lib.packed_full_width(int(blocks == "full"))
        got = {rows: lin(a[:rows]) for rows in [*range(1, 22), 33, 64]}  # every block shape of the packed kernel
        lib.skinny_avx512(0)
        for rows, y in got.items():  # 77 weight rows: a thread's last 5, so a short block ends every kind's pass
            assert torch.equal(bits(y), bits(kernels.skinny_linear(a[:rows], v))), rows
    finally:
        lib.skinny_avx512(1)
        lib.packed_full_width(was)
    for many in (a.repeat(2, 1), a.repeat(4, 1)):  # past the kernel's rows: as the runner's fp32 linear, both ways
        assert torch.equal(bits(lin(many)), bits(kernels.linear(many, v)))
    assert torch.equal(bits(lin(a[:6].view(2, 3, 192))), bits(kernels.skinny_linear(a[:6], v)).view(2, 3, 77))


def test_a_bias_is_added_after_the_product():
    """A biased packed linear (a draft head's input layer): the product's bits, then the bias, at few rows and many."""
    g = torch.Generator().manual_seed(5)
    v = (torch.randn(48, 64, generator=g) * 0.1).half().float()
    bias = torch.randn(48, generator=g)
    plain, biased = W.PackedLinear(W.pack(v)), W.PackedLinear(W.pack(v), bias)
    for rows in (1, 3, 100):
        x = torch.randn(rows, 64, generator=g)
        assert torch.equal(bits(biased(x)), bits(plain(x) + bias))
        assert torch.allclose(biased(x), torch.nn.functional.linear(x, v, bias), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [16, 48])
def test_rows_the_kernel_cannot_read_whole_stay_fp32(k):
    """The kernel reads ``BLOCK`` weights of a row at a time: a weight whose rows are not a multiple of that (a small
    draft model's) stays fp32 rather than be read past its end."""
    g = torch.Generator().manual_seed(4)
    v = (torch.randn(40, k, generator=g)).half().float()
    assert W.pack(v) is None
    assert W.pack(torch.cat([v, v], 1) if k == 16 else torch.cat([v, v[:, :16]], 1)).kind == "f16"  # 32, 64 wide


def quantised_target(tmp_path, tie: bool = False):
    """The tiny fp32 Llama with every weight in a GGUF block format (as a model dequantised from a GGUF file is),
    the norms left as they are, saved as a Hugging Face directory with the tiny tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the block formats need rows of 32 (64 for 4 bits) weights: a tiny Llama of width 64
    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    kinds = {"q_proj": "q4_1", "k_proj": "q4_0", "v_proj": "q8_0", "o_proj": "q4_1", "gate_proj": "q4_1",
             "up_proj": "q4_0", "down_proj": "q4_1", "embed_tokens": "q8_0", "lm_head": "q4_1"}
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = next((k for part, k in kinds.items() if part in name), None)
            if kind is not None:
                p.copy_(gguf_values(p * 6, kind))  # larger than the default init: peaked, varied next tokens
    if tie:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    path = tmp_path / ("tied" if tie else "target")
    model.save_pretrained(path)
    tiny.tokenizer().save_pretrained(path)
    return path, kinds


def test_a_packed_model_gives_the_fp32_models_logits_bit_for_bit(tmp_path):
    path, kinds = quantised_target(tmp_path)
    fp32 = load_model(path, weights="fp32")
    packed = load_model(path, weights="auto")
    report = W.report(packed)
    assert report.unpacked == [] and sum(report.formats.values()) == 2 * 7 + 2
    assert report.formats == {"q4_1": 2 * 4 + 1, "q4_0": 2 * 2, "q8_0": 2 + 1}
    assert report.bytes < report.fp32_bytes / 3
    assert isinstance(packed.model.layers[1].mlp.up_proj, W.PackedLinear) and packed.model.layers[1].mlp.up_proj.packed.kind == "q4_0"
    assert fused.plan(packed) is not None  # the C layer runs the packed model
    prompts = tiny.prompts(4, seed=7)
    from batchspec.batch import prefill

    for q in (1, 3, 6):  # a decode step and verification blocks, every row through the layer kernel
        outs = []
        for model in (fp32, packed):
            state = prefill(Runner(model), prompts)
            ids = torch.tensor([[p[-1]] + [5] * (q - 1) for p in prompts])
            with torch.inference_mode():
                outs.append(state.append(ids, hidden=True))
        assert torch.equal(bits(outs[0].logits), bits(outs[1].logits)), q
        assert torch.equal(bits(outs[0].hidden), bits(outs[1].hidden)), q
    long = [tiny.prompts(1, seed=3, lo=90, hi=100)[0]] * 2  # past the C layer's rows: the model's own modules
    outs = [prefill(Runner(model), long, hidden=True)[1] for model in (fp32, packed)]
    assert torch.equal(bits(outs[0]), bits(outs[1]))


@pytest.mark.parametrize("draft", [None, "prompt-lookup"])
def test_packed_engine_matches_the_oracle_and_the_fp32_engine(tmp_path, draft):
    path, _ = quantised_target(tmp_path, tie=True)
    llm = tiny.fixed_llm(path, draft=draft, batch_size=4)  # drafting every round, whatever the tiny model's costs
    ref = tiny.fixed_llm(path, draft=draft, batch_size=4, weights="fp32")
    assert llm.weights.formats and isinstance(llm.target.lm_head, W.PackedLinear)
    assert llm.target.lm_head.packed is llm.target.model.embed_tokens.packed  # tied: packed once
    assert not ref.weights.formats and ref.weights.bytes == ref.weights.fp32_bytes
    prompts = tiny.prompts(8, seed=11)
    sp = SamplingParams(max_tokens=24)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == [o.token_ids for o in ref.generate(prompts, sp)]
    oracle_model = load_model(path, weights="fp32")
    assert got == [tiny.oracle(oracle_model, p, 24) for p in prompts]
    if draft:
        assert llm.stats.accepted > 0  # speculation ran on the packed model


def test_a_model_object_passed_in_is_never_packed():
    model = tiny.target(dtype=torch.float32)
    before = type(model.model.layers[0].self_attn.q_proj)
    llm = batchspec.LLM(model, batch_size=2)
    assert type(model.model.layers[0].self_attn.q_proj) is before is torch.nn.Linear
    assert llm.weights.formats == {}


def test_weights_mode_is_checked():
    with pytest.raises(ValueError, match="weights must be one of"):
        batchspec.LLM(tiny.target(dtype=torch.float32), weights="q4")


def test_packed_weights_are_cached_and_later_loads_never_read_the_fp32_file(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    path, _ = quantised_target(tmp_path, tie=True)
    first = load_model(path, torch.float32, weights="auto")
    x = torch.tensor([tiny.prompts(1, seed=4, lo=20, hi=30)[0]])
    prompts = tiny.prompts(4, seed=2)
    sp = SamplingParams(max_tokens=12)
    with torch.inference_mode():
        logits = first(x).logits
    outs = [o.token_ids for o in batchspec.LLM(first, batch_size=2).generate(prompts, sp)]
    formats, generation = W.report(first).formats, first.generation_config.to_dict()
    files = list((tmp_path / "cache" / "packed").glob("*.safetensors"))
    assert len(files) == 1
    assert files[0].stat().st_size < (path / "model.safetensors").stat().st_size / 2
    del first  # its norms may be mapped from the file overwritten next
    weights = path / "model.safetensors"  # garbage of the same size and time: a later load must not read it
    st = weights.stat()
    weights.write_bytes(b"\0" * st.st_size)
    import os

    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = load_model(path, torch.float32, weights="auto")
    assert W.report(again).formats == formats
    assert again.lm_head.packed is again.model.embed_tokens.packed  # still tied
    assert again.generation_config.to_dict() == generation  # from the directory, as from_pretrained reads it
    with torch.inference_mode():
        assert torch.equal(bits(logits), bits(again(x).logits))
    assert [o.token_ids for o in batchspec.LLM(again, batch_size=2).generate(prompts, sp)] == outs
    weights.write_bytes(b"\0" * (st.st_size + 1))  # the file changed: the cache no longer applies
    with pytest.raises(Exception):
        load_model(path, torch.float32, weights="auto")


def test_a_new_packed_file_replaces_its_directorys_older_ones_only(tmp_path, monkeypatch):
    """Each packed file is the model's size: one written for changed weights (or kernels) replaces the same
    directory's older ones, and leaves those of another directory with the same name alone."""
    import os

    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    one, _ = quantised_target(tmp_path / "one")
    two, _ = quantised_target(tmp_path / "two")
    assert one.name == two.name
    cached = tmp_path / "cache" / "packed"
    load_model(one, torch.float32, weights="auto")
    load_model(two, torch.float32, weights="auto")
    first = set(cached.glob("*.safetensors"))
    assert len(first) == 2
    st = (one / "model.safetensors").stat()
    os.utime(one / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # weights rewritten
    load_model(one, torch.float32, weights="auto")
    now = set(cached.glob("*.safetensors"))
    assert len(now) == 2 and len(now & first) == 1  # two's file kept, one's replaced
    assert load_model(one, torch.float32, weights="auto") is not None and set(cached.glob("*.safetensors")) == now


# ------------------------------------------------------------------------------------------------- K-quants

KQUANT = {"q4_k": GT.Q4_K, "q5_k": GT.Q5_K, "q6_k": GT.Q6_K}


def kquant_blocks(kind: str, n: int, k: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """``n`` rows of ``k`` weights in ``kind``'s super-blocks, as ggml lays them out: random bytes (codes, 6-bit and
    8-bit scales), with finite fp16 super-block scales of about ``scale`` (and mins; negative ones too)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256, W.KQUANTS[kind]), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // 256, 2)) * scale).astype(np.float16).view(np.uint8)
    if kind == "q6_k":  # ql, qh, scales, then d
        raw[..., 208:] = halves[..., :2]
    else:  # d, dmin, then the rest
        raw[..., :4] = halves
    return raw.reshape(n, -1)


def kquant_values(raw: np.ndarray, kind: str) -> torch.Tensor:
    """gguf's de-quantised values of ``raw``: what a model converted from the GGUF file holds."""
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, KQUANT[kind]))).float()


@pytest.mark.parametrize("kind", list(KQUANT))
def test_kquant_blocks_expand_to_gguf_values(kind):
    raw = kquant_blocks(kind, 40, 512)
    v = kquant_values(raw, kind)
    p = W.PackedWeight(kind, (40, 512), torch.from_numpy(raw))
    assert torch.equal(bits(p.expand()), bits(v))  # the kernel's expansion
    assert torch.equal(bits(W.expand_torch(p)), bits(v))
    ids = torch.tensor([[0, 39], [3, 5]])
    assert torch.equal(bits(p.rows(ids)), bits(v[ids]))
    assert p.nbytes / (4 * v.numel()) == pytest.approx(W.BITS[kind] / 32)
    assert W.pack(v, given=p) is p
    assert W.pack(v) is None  # not found from the values: d * sc is no fp16 (no block format holds them)
    off = v.clone()
    off[7, 300] = torch.nextafter(off[7, 300], torch.tensor(1e9))
    assert W.pack(off, given=p) is None  # blocks that do not give back every value are not used
    assert W.pack(v[:, :256], given=p) is None  # nor blocks of another shape


@pytest.mark.parametrize("blocks", ["full", "avx512", "avx2"])
@pytest.mark.parametrize("kind", list(KQUANT))
def test_packed_kquant_linear_gives_the_fp32_kernels_bits(kind, blocks):
    """As ``test_packed_linear_gives_the_fp32_kernels_bits``, for the K-quants' blocks."""
    lib = kernels.library()
    avx512 = blocks != "avx2"
    if avx512 and not lib.skinny_avx512(1):
        pytest.skip("this CPU has no AVX-512")
    was = lib.packed_full_width(-1)
    raw = kquant_blocks(kind, 77, 512, seed=1)
    v = kquant_values(raw, kind)
    lin = W.PackedLinear(W.pack(v, given=W.PackedWeight(kind, (77, 512), torch.from_numpy(raw))))
    assert lin.packed.kind == kind
    a = torch.randn(80, 512, generator=torch.Generator().manual_seed(3))
    try:
        lib.skinny_avx512(int(avx512))
        lib.packed_full_width(int(blocks == "full"))
        got = {rows: lin(a[:rows]) for rows in [*range(1, 17), 33, 64]}
        lib.skinny_avx512(0)
        for rows, y in got.items():
            assert torch.equal(bits(y), bits(kernels.skinny_linear(a[:rows], v))), rows
    finally:
        lib.skinny_avx512(1)
        lib.packed_full_width(was)
    many = a.repeat(2, 1)  # past the kernel's rows: the expanded weight, as the runner's fp32 linear
    assert torch.equal(bits(lin(many)), bits(kernels.linear(many, v)))


def test_q5_0_blocks_are_kept_as_q8_0():
    """Q5_0 (d * (q - 16), q 5 bits: what a Q4_K_M file holds for rows not a multiple of 256 long) is q8_0 exactly."""
    x = torch.randn(40, 192, generator=torch.Generator().manual_seed(6)) * 0.05
    x[3, :32] = 0.0
    v = torch.from_numpy(quants.dequantize(quants.quantize(x.numpy(), GT.Q5_0), GT.Q5_0)).float()
    p = W.pack(v)
    assert p is not None and p.kind == "q8_0"
    assert torch.equal(bits(p.expand()), bits(v))


def kquant_gguf(tmp_path):
    """A tiny Llama as a GGUF file whose linear and embedding weights are K-quant blocks (as llama.cpp writes them:
    q and k rows in its rotary order), the norms float32; and the kinds by weight."""
    import gguf
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    kinds = {"attn_q": "q4_k", "attn_k": "q5_k", "attn_v": "q6_k", "attn_output": "q4_k", "ffn_gate": "q5_k",
             "ffn_up": "q4_k", "ffn_down": "q6_k", "token_embd": "q6_k", "output": "q4_k"}
    shapes = {"attn_q": (256, 256), "attn_k": (128, 256), "attn_v": (128, 256), "attn_output": (256, 256),
              "ffn_gate": (512, 256), "ffn_up": (512, 256), "ffn_down": (256, 512), "token_embd": (tiny.VOCAB, 256),
              "output": (tiny.VOCAB, 256)}
    w = gguf.GGUFWriter(str(tmp_path / "tiny-k.gguf"), "llama")
    for add, value in [(w.add_context_length, 256), (w.add_embedding_length, 256), (w.add_block_count, 2),
                       (w.add_feed_forward_length, 512), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_rope_dimension_count, 64), (w.add_rope_freq_base, 10000.0),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, tiny.VOCAB)]:
        add(value)
    rng = np.random.default_rng(0)
    seed = iter(range(100))
    for name in ["token_embd", *(f"blk.{i}.{t}" for i in range(2) for t in list(kinds)[:7]), "output"]:
        t = name.split(".")[-1]
        kind, (n, k) = kinds[t], shapes[t]
        scale = {"q4_k": 1e-4, "q5_k": 5e-5, "q6_k": 4e-5}[kind] * (20 if t in ("token_embd", "output") else 1)
        w.add_tensor(f"{name}.weight", kquant_blocks(kind, n, k, next(seed), scale), raw_dtype=KQUANT[kind])
        if t == "attn_output":
            for norm in ("attn_norm", "ffn_norm"):
                w.add_tensor(f"{name[:-len(t)]}{norm}.weight", (1 + 0.3 * rng.standard_normal(256)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "tiny-k.gguf", kinds


def step_logits(model, prompts) -> torch.Tensor:
    """The logits of a verification block of 3 tokens after the prompts, as the engine's runner computes them."""
    from batchspec.batch import prefill

    state = prefill(Runner(model), prompts)
    with torch.inference_mode():
        return state.append(torch.tensor([[p[-1], 5, 7] for p in prompts]), hidden=True).logits


def test_a_kquant_gguf_loads_packed_and_generates_as_its_fp32_twin(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    path, kinds = kquant_gguf(tmp_path)
    fp32 = load_model(path, torch.float32, device="cpu", weights="fp32")
    packed = load_model(path, torch.float32, device="cpu", weights="auto")
    report = W.report(packed)
    assert report.unpacked == []
    assert report.formats == {"q4_k": 2 * 3 + 1, "q5_k": 2 * 2, "q6_k": 2 * 2 + 1}
    assert report.bytes < path.stat().st_size  # the file's blocks, nothing wider
    q = packed.model.layers[1].self_attn.q_proj
    assert isinstance(q, W.PackedLinear) and q.packed.kind == "q4_k"  # q's rows were reordered by the conversion
    assert isinstance(packed.model.embed_tokens, W.PackedEmbedding)
    assert fused.plan(packed) is not None
    prompts = tiny.prompts(4, seed=2)
    logits = [step_logits(model, prompts) for model in (fp32, packed)]  # the runner's fp32 path, and packed
    assert torch.equal(bits(logits[0]), bits(logits[1]))
    sp = SamplingParams(max_tokens=16)
    outs = [o.token_ids for o in batchspec.LLM(fp32, batch_size=2).generate(prompts, sp)]
    assert len(set(map(tuple, outs))) > 1  # the model's tokens depend on its prompt
    assert [o.token_ids for o in batchspec.LLM(packed, batch_size=2).generate(prompts, sp)] == outs
    again = load_model(path, torch.float32, device="cpu", weights="auto")  # from the packed cache
    assert W.report(again).formats == report.formats
    assert torch.equal(bits(logits[0]), bits(step_logits(again, prompts)))
