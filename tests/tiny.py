"""Tiny random models built in-process (fixed seeds), and the independent oracle: HF ``generate`` at batch size 1."""

from __future__ import annotations

import functools

import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

VOCAB = 96
WINDOW = 8  # the tiny Gemma 3's local layers' window, and the tiny Mistral's


def _build(arch: str, seed: int, dtype, attn: str):
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen3":
        cfg = Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
        )
        model = Qwen3ForCausalLM(cfg)
    elif arch == "qwen2":  # q/k/v projections with biases
        cfg = Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        )
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gemma3":  # local layers with a window and global ones, each type its rotary base; GELU MLP
        local, full = "sliding_attention", "full_attention"
        cfg = Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=WINDOW,
            layer_types=[local, full, local, full], query_pre_attn_scalar=8,
        )
        model = Gemma3ForCausalLM(cfg)
    elif arch == "mistral":  # Llama's layer with a window on every layer
        cfg = MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=WINDOW,
            tie_word_embeddings=False,
        )
        model = MistralForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.config._attn_implementation = attn
    # larger weights than the default init give peaked, varied next-token choices instead of near-uniform logits
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(8.0 if p.shape[0] == VOCAB or p.shape[1] == VOCAB else 2.5)
            elif name.endswith("_proj.bias"):  # Qwen2's q/k/v biases, made 0 by the init: random, so that they count
                p.normal_(0.0, 0.05)
            elif arch == "gemma3" and name.endswith("norm.weight"):  # offsets from 1, made 0 by the init
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


@functools.lru_cache(maxsize=None)
def target(arch: str = "llama", dtype=torch.float64, attn: str = "sdpa"):
    return _build(arch, 0, dtype, attn)


@functools.lru_cache(maxsize=None)
def draft(arch: str = "llama", dtype=torch.float64, noise: float = 0.12, attn: str = "sdpa"):
    """A perturbed copy of the target: agrees often, not always, so acceptance is ragged."""
    model = _build(arch, 0, dtype, attn)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std())
    return model


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60, repeat: bool = True) -> list[list[int]]:
    """Prompts of very different lengths; some repeat a phrase so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = lo + (i * 37 + int(torch.randint(0, hi, (1,), generator=g))) % (hi - lo + 1)
        toks = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        if repeat and i % 2 and length >= 8:
            toks = (toks[: length // 2] * 2)[:length]
        out.append(toks)
    return out


_ORACLE: dict = {}


def oracle(model, prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
    """HF ``generate(do_sample=False)`` at batch size 1 with the target alone (memoised per model and request)."""
    key = (id(model), tuple(prompt), max_tokens, tuple(stop_ids or ()))
    if key not in _ORACLE:
        _ORACLE[key] = _generate(model, prompt, max_tokens, stop_ids)
    return list(_ORACLE[key])


def _generate(model, prompt, max_tokens, stop_ids):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens, min_new_tokens=0,
        eos_token_id=list(stop_ids) or None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def tokenizer():
    """A word-level tokenizer over the tiny vocabulary ("w0".."w95"), with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>")
    fast.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
    return fast


def save_dir(path, arch="llama", draft_too=True):
    """Save the tiny target (and its draft) with the tokenizer as local model directories."""
    target(arch).save_pretrained(path / "target")
    tokenizer().save_pretrained(path / "target")
    if draft_too:
        draft(arch).save_pretrained(path / "draft")
    return path / "target", path / "draft"


def fixed_llm(*args, **kwargs):
    """``batchspec.LLM`` drafting K tokens every round: for tests of the round's mechanics (ragged acceptance, holes,
    compaction, counters) that must not depend on the adaptive policy's timing-driven choices."""
    import batchspec

    kwargs.setdefault("speculation", "fixed")
    return batchspec.LLM(*args, **kwargs)


def eagle_head(arch: str = "llama", dtype=torch.float64, vocab: int = 80, steps: int = 300):
    """``(model, fc, token_map)``: a feature-reading draft head for ``target(arch)``, trained here on the target's
    greedy continuations of random prompts (so it agrees often, not always); its head covers the ``vocab`` tokens
    most frequent in those continuations."""
    return _eagle_head(arch, dtype, vocab, steps)


@functools.lru_cache(maxsize=None)
@torch.enable_grad()
def _eagle_head(arch, dtype, vocab, steps):
    from batchspec.training.head import build_head, head_forward

    t = target(arch)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (96, 10), generator=g)
    with torch.no_grad():
        seqs = t.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                          min_new_tokens=40, pad_token_id=0)
        feats = t(seqs, output_hidden_states=True).hidden_states[-1].float()
    token_map = torch.bincount(seqs[:, 10:].flatten(), minlength=VOCAB).argsort(descending=True)[:vocab].sort().values
    torch.manual_seed(0)
    model, fc = build_head(t, token_map)
    where = torch.full((VOCAB,), -100, dtype=torch.long)
    where[token_map] = torch.arange(vocab)
    emb = t.get_input_embeddings()
    opt = torch.optim.Adam(list(model.parameters()) + list(fc.parameters()), lr=3e-3)
    for _ in range(steps):
        states, logits = head_forward(model, fc, lambda x: emb(x).float(), seqs[:, 1:], feats[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), where[seqs[:, 2:]].flatten(),
                                                 ignore_index=-100)
        loss = loss + torch.nn.functional.smooth_l1_loss(states, feats[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.to(dtype).eval().requires_grad_(False), fc.to(dtype).requires_grad_(False), token_map


def eagle(arch: str = "llama", dtype=torch.float64, graphs: str = "auto", copy: bool = True):
    """A fresh ``EagleDrafter`` over ``eagle_head`` (drafters hold runners: one per LLM)."""
    from batchspec.drafters import EagleDrafter

    model, fc, token_map = eagle_head(arch, dtype)
    return EagleDrafter(model, fc, token_map, target(arch, dtype).get_input_embeddings(), graphs, copy)


def profile(fixed: float = 0.02, per_token: float = 0.002, step: float = 0.0, pair: float = 0.0, rows=(1, 2, 4, 8),
            attend: tuple[float, float] | None = None):
    """A cost profile (``batchspec.speculation.Profile``) whose forward of r rows x w tokens takes ``fixed + per_token
    * r * w`` seconds and the drafter's step ``step`` per row (0: none): forwards priced like a real model's, for the
    adaptive policy over tiny models (whose own forwards are far cheaper than a round's bookkeeping). ``attend``:
    ``(a, d)``, seconds per row and cached token past ``CONTEXT`` of a plain step, and of each more token a row (a
    long measurement at ``LONG``); None: none."""
    from batchspec.speculation import Profile
    from batchspec.speculation.costs import CONTEXT, LONG, WIDTHS

    target = {r: [fixed + per_token * r * w for w in WIDTHS] for r in rows}
    long = {}
    if attend is not None:
        a, d = attend
        long = {r: (LONG, [target[r][i] + (LONG - CONTEXT) * r * (a + d * (WIDTHS[i] - 1)) for i in (0, -1)])
                for r in rows}
    return Profile(target, {r: step * r for r in rows} if step else {}, pair, long=long)
