"""The feature-reading head's training side (``batchspec train-draft --kind head``): a fresh head shaped like its
target (``build_head``), the forwards training runs over whole sequences (the same arithmetic as drafting, without a
cache; ``head_unrolled``: several drafting steps at once, training-time test), its loss (``head_loss``), the train
stage (``train_head``: the head learns to predict the next feature and the target's next-token distribution, with the
target's embedding and head frozen; resumable) and the export stage (``export_head``: a draft folder in
``EagleDrafter.save``'s format)."""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama as hf

from ..progress import Progress


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
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
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


# --------------------------------------------------------------------------------------------------------- train


def head_loss(model, fc, emb, head_w, batch, depth: int, noise: float, reg: float, soft: float, hard: float):
    """The loss of one ``collate`` batch summed over ``depth`` drafting steps (divided by ``depth``), and each step's
    top-1 agreement with the target at answer positions. Per step: ``reg`` x smooth-L1 regression of the next
    feature and ``soft`` x cross-entropy against the target's distribution over the head's tokens (``head_w``: its
    output rows) at every position, plus ``hard`` x cross-entropy on the target's token at answer positions; input
    features get uniform noise of +-``noise``."""
    nxt, f_in, f_out, label, real, answer = batch
    if noise:
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * 2 * noise
    with torch.no_grad():
        teacher = (f_out @ head_w.T).log_softmax(-1)
    total, hits = 0.0, []
    for d, (states, logits) in enumerate(head_unrolled(model, fc, emb, nxt, f_in, depth)):
        logp = logits.log_softmax(-1)
        soft_ce = -(teacher.exp() * logp).sum(-1)
        reg_l1 = F.smooth_l1_loss(states, f_out, reduction="none").mean(-1)
        hard_ce = F.cross_entropy(logits.flatten(0, 1), label.flatten(), reduction="none",
                                  ignore_index=-100).view_as(soft_ce)
        w = real.clone()
        w[:, :d] = False  # step d at position i starts from the real feature f_(i-d)
        ans = answer & w
        a = (ans & (label >= 0)).float()
        w = w.float()
        total = total + ((reg * reg_l1 + soft * soft_ce) * w).sum() / w.sum() + \
            hard * (hard_ce * a).sum() / a.sum().clamp(min=1)
        hits.append(float(((logits.argmax(-1) == teacher.argmax(-1)) & ans).sum() / ans.sum().clamp(min=1)))
    return total / depth, hits


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def resume_path(save: Path) -> Path:
    """Where an unfinished train run keeps its state (optimizer included), beside its checkpoint ``save``."""
    return save.with_name(save.name.removesuffix(".pt") + ".resume.pt")


# the flags that do not change what training computes (the gen stage's among them): a run resumes under other values
NOT_SETTINGS = {"log_every", "eval_every", "threads", "stages", "out", "work", "command", "follow", "prompts",
                "passages", "num_prompts", "max_new_tokens", "batch", "chunk", "chunks", "topk", "heldout", "device",
                "gen_seconds"}


def settings_of(args) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if k not in NOT_SETTINGS}


def load_resume(path: Path, args) -> dict | None:
    """The state an interrupted run with the same settings left at ``path`` (None: none); another run's state is an
    error that says how to go on."""
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu")
    if state["settings"] != settings_of(args):
        have, want = state["settings"], settings_of(args)
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        raise ValueError(f"{path} holds an interrupted train run with other settings ({', '.join(diff)}); rerun it "
                         "with its flags to finish it, or delete that file to start over")
    return state


def train_head(args) -> dict:
    """The train stage of a head: train on the chunks of ``args.data`` and write the checkpoint ``args.save``
    (``model``, ``fc``, ``token_map``, ``info``); ``args.init`` continues from an earlier checkpoint (its token
    map kept). Every ``args.eval_every`` steps the held-out loss is logged and the checkpoint written, with the
    optimizer's state beside it (``resume_path``), from which the same command resumes. Returns the info."""
    from ..model.loading import load_model
    from .data import batches, collate, load_chunks, log, token_map_of

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dirs = [Path(d) for d in args.data]
    save = Path(args.save)
    resume = load_resume(resume_path(save), args)
    device = torch.device(getattr(args, "device", "cpu"))
    target = load_model(args.target, torch.float32, device)
    seen: set = set()
    seqs, feats, starts = load_chunks(dirs, seen)
    if not seqs:
        raise ValueError(f"no gen chunks in {', '.join(map(str, dirs))}: run the gen stage first")
    vocab = target.config.vocab_size
    init = torch.load(args.init, map_location="cpu") if args.init else None
    token_map = init["token_map"] if init else token_map_of(seqs, starts, vocab, args.vocab)
    where = torch.full((vocab,), -100, dtype=torch.long)
    where[token_map] = torch.arange(len(token_map))
    answers = sum(len(s) - p for s, p in zip(seqs, starts))
    covered = sum(int((where[s[p:]] >= 0).sum()) for s, p in zip(seqs, starts))
    log(f"data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens ({answers} answer tokens); head of "
        f"{len(token_map)} tokens covers {covered / answers:.4f} of answer tokens")
    model, fc = build_head(target, token_map, None if args.random_layer else args.copy_layer)
    model, fc = model.to(device), fc.to(device)
    if init:
        model.load_state_dict(init["model"])
        fc.load_state_dict(init["fc"])
        log(f"initialised from {args.init} ({init['info']['steps']} steps)")
    emb = target.get_input_embeddings()
    head_w = target.lm_head.weight[token_map].detach()  # the target's scores over the head's tokens
    model.lm_head.weight.requires_grad_(False)  # tied to the embedding table: the target's rows, frozen
    params = [p for p in list(model.parameters()) + list(fc.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    held = lambda: list(range(0, len(seqs), 50))  # noqa: E731  (every 50th sequence: the loss curve's)
    train = lambda: [i for i in range(len(seqs)) if i % 50]  # noqa: E731
    total = args.max_steps
    if total is None:
        total = args.epochs * len(batches([len(seqs[i]) for i in train()], args.batch_tokens, rng))
    warm = max(1, total // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(total, 1))))))
    log(f"training {sum(p.numel() for p in params) / 1e6:.2f} M parameters, {total} steps")
    t0, first = time.perf_counter(), 0

    def losses(rows, noise: float):
        batch = tuple(t.to(device) for t in collate(rows, seqs, feats, starts, where))
        return head_loss(model, fc, emb, head_w, batch, args.depth, noise, args.reg, args.soft, args.hard)

    def plan():
        """Epochs of batches; with ``--follow``, chunks the gen stage wrote meanwhile join at each epoch."""
        epoch = 0
        while True:
            if args.follow and epoch:
                more = load_chunks(dirs, seen)
                for have, new in zip((seqs, feats, starts), more):
                    have += new
                if more[0]:
                    log(f"epoch {epoch}: {len(more[0])} more sequences, {len(seqs)} in all")
            ids = train()
            for b in batches([len(seqs[i]) for i in ids], args.batch_tokens, rng):
                yield [ids[i] for i in b]
            epoch += 1

    def checkpoint(step):
        info = {"sequences": len(seqs), "tokens": sum(map(len, seqs)), "answer_tokens": sum(len(s) - p for s, p in zip(
                seqs, starts)), "head_tokens": len(token_map), "steps": step, "batch_tokens": args.batch_tokens,
                "seconds": round(time.perf_counter() - t0), "threads": args.threads, "args": vars(args),
                "continued_from": init["info"] if init else None}
        torch.save({"model": model.state_dict(), "fc": fc.state_dict(), "token_map": token_map, "info": info},
                   save)
        return info

    def evaluate():
        val = held()
        with torch.no_grad():
            model.eval()
            vals = [losses(val[i: i + 16], 0.0) for i in range(0, len(val), 16)]
            model.train()
        hit = [sum(v[1][d] for v in vals) / len(vals) for d in range(args.depth)]
        log(f"held-out ({len(val)} sequences): loss {sum(float(v[0]) for v in vals) / len(vals):.4f} top-1 "
            f"agreement at answer positions, per drafting step {fmt(hit)}")

    batches_of = plan()
    if resume is not None:  # the same batches as the interrupted run: its plan replayed up to where it stopped
        first = resume["step"]
        for _ in zip(range(first), batches_of):
            pass
        model.load_state_dict(resume["model"])
        fc.load_state_dict(resume["fc"])
        opt.load_state_dict(resume["opt"])
        sched.load_state_dict(resume["sched"])
        torch.set_rng_state(resume["rng"])
        if resume.get("cuda_rng") is not None and device.type == "cuda":
            torch.cuda.set_rng_state(resume["cuda_rng"], device)
        t0 -= resume["seconds"]
        log(f"resuming from step {first} ({resume_path(save)})")
    step = first
    try:
        with Progress(True, total, "training the head") as bar:
            bar.update(first)
            for step, rows in zip(range(first, total), batches_of):
                loss, hit = losses(rows, args.noise)
                opt.zero_grad()
                loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
                opt.step()
                sched.step()
                bar.advance()
                if step % args.log_every == 0 or step == total - 1:
                    bar.describe(f"training the head: loss {loss.item():.3f}")
                    log(f"step {step}/{total} loss {loss.item():.4f} top-1 {fmt(hit)} grad {gnorm.item():.2f} "
                        f"lr {sched.get_last_lr()[0]:.2e} {time.perf_counter() - t0:.0f} s")
                if (step + 1) % args.eval_every == 0 or step == total - 1:
                    evaluate()
                    checkpoint(step + 1)
                    if step + 1 < total:
                        torch.save({"step": step + 1, "model": model.state_dict(), "fc": fc.state_dict(),
                                    "opt": opt.state_dict(), "sched": sched.state_dict(), "rng": torch.get_rng_state(),
                                    "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                                    "seconds": time.perf_counter() - t0, "settings": settings_of(args)},
                                   resume_path(save))
    except KeyboardInterrupt:
        state = resume_path(save)
        how = f"the same command resumes from the state in {state}" if state.is_file() else \
            "no checkpoint yet; the same command starts over"
        log(f"interrupted at step {step}: {how}")
        raise
    if not total:
        evaluate()
    info = checkpoint(total)
    resume_path(save).unlink(missing_ok=True)
    log(f"saved {save}: {info}")
    return info


# --------------------------------------------------------------------------------------------------------- export


def portable(info, base: Path):
    """``info`` with paths inside ``base`` written relative to it (a card names no machine's folders)."""
    if isinstance(info, dict):
        return {k: portable(v, base) for k, v in info.items()}
    if isinstance(info, list):
        return [portable(v, base) for v in info]
    if isinstance(info, str) and info.startswith(str(base) + os.sep):
        return info[len(str(base)) + 1:]
    return info


def export_head(target_spec, save: Path, out: Path, tokenizer) -> None:
    """Write the checkpoint ``save`` as a draft folder ``batchspec.LLM(target, draft=out)`` loads: float16 weights
    (``EagleDrafter.save``), the card ``eagle.json`` (the checkpoint's info) and the target's tokenizer. Files
    already in ``out`` go, except a README.md (a model card)."""
    from ..drafters.eagle import EagleDrafter
    from ..model.loading import load_model
    from .data import log

    ck = torch.load(save, map_location="cpu")
    target = load_model(target_spec, torch.float32, "cpu")
    model, fc = build_head(target, ck["token_map"], None)
    model.load_state_dict(ck["model"])
    fc.load_state_dict(ck["fc"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name != "README.md" and old.is_file():
            old.unlink()
    model.half()
    fc.half()
    model.generation_config.eos_token_id = target.generation_config.eos_token_id
    EagleDrafter.save(out, model, fc, ck["token_map"], portable(ck["info"], Path.cwd()))
    tokenizer.save_pretrained(out)
    log(f"exported to {out}")
