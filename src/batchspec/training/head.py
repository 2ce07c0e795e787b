"""The feature-reading head's training side: a fresh head shaped like its target, and the forwards training runs
over whole sequences (the same arithmetic as drafting, without a cache; ``head_unrolled``: several drafting steps at
once, training-time test)."""

from __future__ import annotations

import torch
from transformers.models.llama import modeling_llama as hf


def build_head(target, token_map: torch.Tensor, copy_layer: int | None = -1):
    """A fresh head for ``target`` (``(model, fc)``, in training mode, float32): one Llama decoder layer shaped like
    the target's, its output head (tied to the model's embedding table) the target's head rows ``token_map``, its
    final norm the target's. A Llama target's layer ``copy_layer`` initialises the decoder layer (None: random)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config.get_text_config()
    hidden = tc.hidden_size
    heads = getattr(tc, "num_attention_heads", None) or max(1, hidden // 64)
    cfg = LlamaConfig(
        vocab_size=len(token_map), hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        intermediate_size=getattr(tc, "intermediate_size", 4 * hidden),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048), rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
        rope_parameters=getattr(tc, "rope_parameters", None), tie_word_embeddings=True,
        head_dim=getattr(tc, "head_dim", hidden // heads), attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).float()
    fc = torch.nn.Linear(2 * hidden, hidden, bias=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target.get_output_embeddings().weight[token_map].float())
        inner = getattr(target, "model", None)
        if copy_layer is not None and type(target).__name__ == "LlamaForCausalLM":
            model.model.layers[0].load_state_dict(inner.layers[copy_layer].state_dict())
            model.model.norm.load_state_dict(inner.norm.state_dict())
        fc.weight.mul_(0.5)
    return model.train(), fc


def head_forward(model, fc, embedding, next_tokens: torch.Tensor, feats: torch.Tensor, attention_mask=None):
    """Training forward over whole sequences: ``(predicted features, logits over the head's tokens)`` for the pairs
    (``feats[:, i]``, ``next_tokens[:, i]``); the same arithmetic as drafting, without a cache."""
    x = fc(torch.cat([embedding(next_tokens).to(fc.weight.dtype), feats.to(fc.weight.dtype)], -1))
    states = model.model(inputs_embeds=x, attention_mask=attention_mask).last_hidden_state
    return states, model.lm_head(states)


def head_unrolled(model, fc, embedding, next_tokens: torch.Tensor, feats: torch.Tensor, depth: int):
    """Training forward of ``depth`` drafting steps at every position at once (training-time test): a list, one
    ``(states, logits)`` per step d = 0..depth-1. Step d at position i is the head's d+1-th draft in a round whose
    last real feature is f_(i-d): its input pair is (step d-1's output at i-1, x_(i+1)) and it sees the real pairs
    up to position i-d and its own round's pairs i-d+1..i, exactly as drafting does (with the true tokens, those of
    the round in which every earlier draft was accepted). Step 0 is ``head_forward``. Right padding only."""
    layer, inner = model.model.layers[0], model.model
    attn = layer.self_attn
    R, n, _ = feats.shape
    pos = torch.arange(n, device=feats.device)
    emb = embedding(next_tokens).to(fc.weight.dtype)
    x = fc(torch.cat([emb, feats.to(fc.weight.dtype)], -1))
    cos, sin = inner.rotary_emb(x, pos[None])
    keys, values, out = [], [], []
    i, j = pos[:, None], pos[None, :]
    for d in range(depth):
        if d:  # the previous step's predicted feature of position i, from its output at i-1
            prev = torch.nn.functional.pad(out[-1][0][:, :-1], (0, 0, 1, 0))
            x = fc(torch.cat([emb, prev], -1))
        h = layer.input_layernorm(x)
        shape = (R, n, -1, attn.head_dim)
        q, k = hf.apply_rotary_pos_emb(attn.q_proj(h).view(shape).transpose(1, 2),
                                       attn.k_proj(h).view(shape).transpose(1, 2), cos, sin)
        keys.append(k)
        values.append(attn.v_proj(h).view(shape).transpose(1, 2))
        # visible: real pairs j <= i-d, and step e's pair at i-d+e for e = 1..d
        mask = torch.cat([j <= i - d] + [j == i - d + e for e in range(1, d + 1)], 1)
        k = torch.cat(keys, 2).repeat_interleave(attn.num_key_value_groups, 1)
        v = torch.cat(values, 2).repeat_interleave(attn.num_key_value_groups, 1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        y = x + attn.o_proj(a.transpose(1, 2).reshape(R, n, -1))
        y = y + layer.mlp(layer.post_attention_layernorm(y))
        states = inner.norm(y)
        out.append((states, model.lm_head(states)))
    return out
