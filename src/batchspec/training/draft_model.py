"""Train the ``smollm2-135m-draft-model`` draft model for the ``smollm2-135m`` target by distillation, on CPU.

Stages (each reads the previous one's output from ``--work``; ``all`` runs gen, train and export in order):

1. ``gen``: the target answers the training prompts (``scripts/draft_prompts.py``, written for this and disjoint from
   the built-in evaluation prompts) greedily through its chat template; every answer token is stored with the
   target's top-k log-probabilities at that step.
2. ``train``: a small ``LlamaForCausalLM`` (same vocabulary and tokenizer, tied embedding/head, full attention) whose
   embedding starts as a projection of the target's output embedding onto its top singular directions is trained on
   those sequences: soft cross-entropy on the target's top-k distribution plus hard cross-entropy on the target's
   greedy token, at answer positions only.
3. ``export``: float16 safetensors, config, generation config and the tokenizer into
   ``src/batchspec/data/smollm2-135m-draft-model``.
4. ``eval`` (separate): mean accepted length with ``batchspec.LLM`` at K draft tokens on the built-in prompts, and the
   per-token cost of the draft relative to the target (multiply-accumulates, and measured decode-step time).

Everything is seeded; one thread (``torch.set_num_threads(1)``) throughout. Example::

    python scripts/train_draft.py all
    python scripts/train_draft.py eval --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draft_prompts import HeldOut, training_prompts  # noqa: E402

TARGET = "smollm2-135m"
OUT_DIR = ROOT / "src" / "batchspec" / "data" / "smollm2-135m-draft-model"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def held_out_texts() -> list[str]:
    from batchspec.data import builtin_prompts

    return [t for _, t in builtin_prompts()]


# --------------------------------------------------------------------------------------------------------- gen


@torch.no_grad()
def greedy_rows(model, prompts: list[list[int]], max_new: int, topk: int, eos: set[int], pad: int):
    """Greedy decoding of a left-padded batch that drops rows from the batch (and the KV cache) as they finish.
    Returns, per prompt, the answer ids (through the first EOS) and the target's top-k log-probs at each step."""
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits[:, -1]
    rows = torch.arange(len(prompts))
    nxt_pos = pos[:, -1] + 1
    answers = [[] for _ in prompts]
    lps = [[] for _ in prompts]
    idxs = [[] for _ in prompts]
    for step in range(max_new):
        lp, ix = logits.float().log_softmax(-1).topk(topk, -1)
        tok = ix[:, 0]
        done = []
        for j, r in enumerate(rows.tolist()):
            answers[r].append(int(tok[j]))
            lps[r].append(lp[j].to(torch.float16))
            idxs[r].append(ix[j].to(torch.int32))
            done.append(int(tok[j]) in eos or step == max_new - 1)
        keep = torch.tensor([not d for d in done])
        if not keep.any():
            break
        if not keep.all():
            sel = keep.nonzero()[:, 0]
            cache.batch_select_indices(sel)
            rows, tok, mask, nxt_pos = rows[sel], tok[sel], mask[sel], nxt_pos[sel]
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], 1)
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=nxt_pos[:, None], past_key_values=cache,
                       use_cache=True).logits[:, -1]
        nxt_pos = nxt_pos + 1
    return [(a, torch.stack(lp), torch.stack(ix)) for a, lp, ix in zip(answers, lps, idxs)]


def generate(model, tok, texts: list[str], max_new: int, batch: int, topk: int, label: str) -> list[dict]:
    """Greedy answers (through the chat template) with the target's top-k log-probs, one dict per text."""
    from batchspec.prompts import encode

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    prompts = encode(tok, texts, True)
    order = sorted(range(len(texts)), key=lambda i: len(prompts[i]))
    out: list[dict | None] = [None] * len(texts)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        for r, (ans, lp, ix) in zip(rows, greedy_rows(model, [prompts[r] for r in rows], max_new, topk, eos, pad)):
            out[r] = {"prompt": prompts[r], "answer": ans, "lp": lp, "idx": ix}
        done = min(start + batch, len(order))
        toks = sum(len(o["answer"]) for o in out if o is not None)
        log(f"{label}: {done}/{len(order)} prompts, {toks} answer tokens, {time.perf_counter() - t0:.0f} s")
    return out


def cmd_gen(args) -> None:
    from batchspec.model.loading import load_model, load_tokenizer

    torch.set_num_threads(1)
    seed_all(args.seed)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    held = held_out_texts()
    pairs = training_prompts(args.num_prompts, args.seed, held)
    guard = HeldOut(held)
    assert not any(guard.overlaps(t) for _, t in pairs), "training prompts overlap the built-in prompts"
    model = load_model(TARGET, torch.float32, "cpu")
    tok = load_tokenizer(TARGET)
    if args.heldout:
        data = generate(model, tok, held, args.max_new_tokens, args.batch, args.topk, "held-out")
        torch.save({"records": data, "categories": None}, work / "heldout.pt")
    t0 = time.perf_counter()
    # grouping by category keeps answers of similar length in one generate() batch
    by_cat: dict[str, list[str]] = {}
    for cat, text in pairs:
        by_cat.setdefault(cat, []).append(text)
    records, cats = [], []
    for cat, texts in by_cat.items():
        recs = generate(model, tok, texts, args.max_new_tokens, args.batch, args.topk, cat)
        records += recs
        cats += [cat] * len(recs)
    wall = time.perf_counter() - t0
    torch.save({"records": records, "categories": cats, "prompts": [t for _, t in pairs]}, work / "train.pt")
    info = {"prompts": len(records), "answer_tokens": sum(len(r["answer"]) for r in records),
            "prompt_tokens": sum(len(r["prompt"]) for r in records), "seconds": round(wall, 1),
            "max_new_tokens": args.max_new_tokens, "topk": args.topk, "seed": args.seed}
    (work / "gen.json").write_text(json.dumps(info, indent=1))
    log(f"gen done: {info}")


# --------------------------------------------------------------------------------------------------------- model


def draft_config(target_cfg, hidden: int, layers: int, heads: int, inter: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_cfg.vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=target_cfg.max_position_embeddings, rope_parameters=dict(target_cfg.rope_parameters),
        rms_norm_eps=target_cfg.rms_norm_eps, tie_word_embeddings=True, bos_token_id=target_cfg.bos_token_id,
        eos_token_id=target_cfg.eos_token_id, pad_token_id=target_cfg.pad_token_id, hidden_act="silu",
        attention_bias=False, mlp_bias=False,
    )


@torch.no_grad()
def projected_embedding(target, hidden: int, records=None, max_records: int = 48) -> torch.Tensor:
    """The target's effective output embedding ``W = E diag(g)`` (embedding times final-norm gain) mapped to
    ``hidden`` dimensions, ``W @ P``, rows rescaled to ``W``'s mean row norm.

    Without ``records`` ``P`` spans ``W``'s top right singular directions. With them it is data-weighted: the
    target's normalised final hidden states ``n`` at answer positions give ``C = E[n n^T]``; with
    ``W C^(1/2) = U S R^T``, ``P = C^(1/2) R_h``, so that the span of ``W P`` holds the best rank-``hidden``
    approximation of the target's logits on that data."""
    E = target.get_output_embeddings().weight.detach().float()
    g = target.model.norm.weight.detach().float()
    W = E * g
    if records is None:
        _, _, Vh = torch.linalg.svd(W, full_matrices=False)
        P = Vh[:hidden].T
    else:
        hs = []
        for r in records[:max_records]:
            ids = torch.tensor([r["prompt"] + r["answer"]])
            out = target.model(input_ids=ids).last_hidden_state[0] / g
            p, a = len(r["prompt"]), len(r["answer"])
            hs.append(out[p - 1:p - 1 + a])
        n = torch.cat(hs)
        ev, evec = torch.linalg.eigh(n.T @ n / len(n))
        root = evec @ torch.diag(ev.clamp(min=1e-8).sqrt()) @ evec.T
        _, _, Rh = torch.linalg.svd(W @ root, full_matrices=False)
        P = root @ Rh[:hidden].T
    emb = W @ P
    return emb * (W.norm(dim=1).mean() / emb.norm(dim=1).mean())


@torch.no_grad()
def residual_basis(target, records, layers: list[int], hidden: int, max_records: int = 32):
    """The top ``hidden`` principal directions (uncentred) of the target's residual stream where the draft will read
    it (inputs of ``layers`` and the final pre-norm state), plus each chosen layer's MLP neuron importance
    (mean |activation| times the norm of the neuron's output weights)."""
    acts = {i: [] for i in layers}
    hooks = [target.model.layers[i].mlp.down_proj.register_forward_hook(
        lambda m, inp, out, i=i: acts[i].append(inp[0][0].abs().mean(0))) for i in layers]
    states = []
    try:
        for r in records[:max_records]:
            out = target(input_ids=torch.tensor([r["prompt"] + r["answer"]]), output_hidden_states=True)
            hs = out.hidden_states  # embeddings, then every layer's output (the last one after the final norm)
            states += [hs[i][0] for i in layers] + [hs[-1][0] / target.model.norm.weight]
    finally:
        for h in hooks:
            h.remove()
    X = torch.cat([x * x.pow(2).mean(-1, keepdim=True).rsqrt() for x in states])  # each state counts once
    ev, evec = torch.linalg.eigh(X.T @ X / len(X))
    basis = evec[:, -hidden:].flip(1)
    importance = {i: torch.stack(acts[i]).mean(0) * target.model.layers[i].mlp.down_proj.weight.norm(dim=0)
                  for i in layers}
    return basis, importance


@torch.no_grad()
def compressed_target(target, records, args):
    """A draft made of some of the target's own layers with the residual stream compressed to ``hidden`` dimensions
    (``x ~ P r`` with ``P`` the residual basis; every weight reading the residual is multiplied by ``P``, every weight
    writing it by ``P^T``, RMSNorm gains folded into the weights that follow them), attention kept whole and each MLP
    pruned to its ``intermediate`` most important neurons. The embedding/head is ``E P``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    layers = [int(x) for x in args.from_layers.split(",")]
    P, importance = residual_basis(target, records, layers, args.hidden)
    scale = (tc.hidden_size / args.hidden) ** 0.5  # RMS over fewer dimensions
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=len(layers), num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        max_position_embeddings=tc.max_position_embeddings, rope_parameters=dict(tc.rope_parameters),
        rms_norm_eps=tc.rms_norm_eps, tie_word_embeddings=True, bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id, hidden_act=tc.hidden_act,
        attention_bias=False, mlp_bias=False,
    )
    draft = LlamaForCausalLM(cfg)
    draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight @ P)
    for j, i in enumerate(layers):
        src, dst = target.model.layers[i], draft.model.layers[j]
        g1, g2 = src.input_layernorm.weight, src.post_attention_layernorm.weight
        dst.input_layernorm.weight.fill_(scale)
        dst.post_attention_layernorm.weight.fill_(scale)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(dst.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight * g1 @ P)
        dst.self_attn.o_proj.weight.copy_(P.T @ src.self_attn.o_proj.weight)
        keep = importance[i].topk(args.intermediate).indices.sort().values
        dst.mlp.gate_proj.weight.copy_((src.mlp.gate_proj.weight * g2 @ P)[keep])
        dst.mlp.up_proj.weight.copy_((src.mlp.up_proj.weight * g2 @ P)[keep])
        dst.mlp.down_proj.weight.copy_(P.T @ src.mlp.down_proj.weight[:, keep])
    draft.model.norm.weight.copy_(torch.diagonal(P.T @ torch.diag(target.model.norm.weight) @ P) * scale)
    draft.tie_weights()
    return draft


def build_draft(target, args, records=None):
    from transformers import LlamaForCausalLM

    seed_all(args.seed)
    if args.init == "layers":
        return compressed_target(target, records, args)
    cfg = draft_config(target.config, args.hidden, args.layers, args.heads, args.intermediate)
    draft = LlamaForCausalLM(cfg)
    emb = projected_embedding(target, args.hidden, records if args.init == "data" else None)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(emb)
    draft.tie_weights()
    return draft


# --------------------------------------------------------------------------------------------------------- train


def batches(records, max_tokens: int, rng: random.Random):
    """Batches of record indices whose padded size stays under ``max_tokens``; similar lengths together."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt"]) + len(records[i]["answer"]))
    out, cur, width = [], [], 0
    for i in order:
        n = len(records[i]["prompt"]) + len(records[i]["answer"])
        if cur and max(width, n) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(records, rows, pad: int):
    """Right-padded input ids (causal attention makes an attention mask unnecessary), the flat positions whose output
    predicts an answer token, and the targets there: top-k ids/log-probs and the greedy token."""
    seqs = [records[r]["prompt"] + records[r]["answer"] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    pos, idx, lp, hard = [], [], [], []
    for j, (r, s) in enumerate(zip(rows, seqs)):
        ids[j, : len(s)] = torch.tensor(s)
        p, a = len(records[r]["prompt"]), len(records[r]["answer"])
        pos.append(torch.arange(p - 1, p - 1 + a) + j * width)
        idx.append(records[r]["idx"].long())
        lp.append(records[r]["lp"].float())
        hard.append(torch.tensor(records[r]["answer"]))
    return ids, torch.cat(pos), torch.cat(idx), torch.cat(lp), torch.cat(hard)


def loss_fn(draft, batch, hard_weight: float, negatives: int, gen: torch.Generator):
    """Soft cross-entropy on the target's top-k distribution plus ``hard_weight`` times the cross-entropy of its
    greedy token. With ``negatives`` > 0 the softmax runs over a sampled candidate set (every top-k token of the
    batch plus ``negatives`` uniformly drawn ids) instead of the whole vocabulary, which makes the output head, the
    bulk of the cost, several times cheaper."""
    ids, pos, idx, lp, hard = batch
    hidden = draft.model(input_ids=ids).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1])[pos]
    weight = draft.lm_head.weight
    if negatives:
        extra = torch.randint(0, weight.shape[0], (negatives,), generator=gen)
        cand = torch.unique(torch.cat([idx.flatten(), hard, extra]))
        logq = F.log_softmax((h @ weight[cand].T).float(), -1)
        idx, hard = torch.searchsorted(cand, idx), torch.searchsorted(cand, hard)
    else:
        logq = F.log_softmax(draft.lm_head(h).float(), -1)
    soft = -(lp.exp() * logq.gather(1, idx)).sum(-1).mean()
    hard_ce = F.nll_loss(logq, hard)
    agree = (logq.detach().argmax(-1) == hard).float().mean()
    return soft + hard_weight * hard_ce, agree


@torch.no_grad()
def agreement(draft, records, pad: int, max_tokens: int = 4096) -> float:
    """Share of answer positions where the draft's argmax is the target's greedy token (teacher forcing)."""
    draft.eval()
    hit = tot = 0
    for rows in batches(records, max_tokens, random.Random(0)):
        ids, pos, _, _, hard = collate(records, rows, pad)
        hidden = draft.model(input_ids=ids).last_hidden_state
        pred = draft.lm_head(hidden.reshape(-1, hidden.shape[-1])[pos]).argmax(-1)
        hit += int((pred == hard).sum())
        tot += len(hard)
    draft.train()
    return hit / max(tot, 1)


def cmd_train(args) -> None:
    from batchspec.model.loading import load_model

    torch.set_num_threads(1)
    work = Path(args.work)
    data = torch.load(work / "train.pt", weights_only=False)
    records = data["records"]
    heldout = torch.load(work / "heldout.pt", weights_only=False)["records"] if (work / "heldout.pt").exists() else None
    target = load_model(TARGET, torch.float32, "cpu")
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    draft = build_draft(target, args, records)
    del target
    draft.train()
    emb = draft.model.embed_tokens.weight
    other = [p for n, p in draft.named_parameters() if p is not emb]
    opt = torch.optim.AdamW([{"params": other, "lr": args.lr, "weight_decay": 0.01},
                             {"params": [emb], "lr": args.lr * args.emb_lr_scale, "weight_decay": 0.0}],
                            betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    epochs = [batches(records, args.batch_tokens, rng) for _ in range(args.epochs)]
    total = sum(len(e) for e in epochs)
    if args.max_steps:
        total = min(total, args.max_steps)
    warm = max(1, int(0.03 * total))
    base = [g["lr"] for g in opt.param_groups]
    log(f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M params; {len(records)} sequences, "
        f"{args.epochs} epochs, {total} steps")
    if heldout is not None:
        log(f"held-out agreement at init {agreement(draft, heldout, pad):.3f}")
    t0, step, ema = time.perf_counter(), 0, None
    for ep, plan in enumerate(epochs):
        for rows in plan:
            if step >= total:
                break
            scale = min(1.0, (step + 1) / warm) * (0.5 * (1 + math.cos(math.pi * step / total)) * 0.9 + 0.1)
            for g, b in zip(opt.param_groups, base):
                g["lr"] = b * scale
            loss, agree = loss_fn(draft, collate(records, rows, pad), args.hard_weight, args.negatives, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            step += 1
            ema = float(agree) if ema is None else 0.98 * ema + 0.02 * float(agree)
            if step % args.log_every == 0 or step == total:
                log(f"epoch {ep + 1} step {step}/{total} loss {float(loss):.3f} train agreement (ema) {ema:.3f} "
                    f"{time.perf_counter() - t0:.0f} s")
        if heldout is not None:
            log(f"epoch {ep + 1}: held-out agreement {agreement(draft, heldout, pad):.3f}")
    wall = time.perf_counter() - t0
    draft.save_pretrained(work / "draft")
    info = {"steps": total, "epochs": args.epochs, "seconds": round(wall, 1), "args": vars(args),
            "train_answer_tokens": sum(len(r["answer"]) for r in records)}
    if heldout is not None:
        info["heldout_agreement"] = round(agreement(draft, heldout, pad), 4)
    (work / "train.json").write_text(json.dumps(info, indent=1, default=str))
    log(f"train done in {wall:.0f} s: {info.get('heldout_agreement')}")


# --------------------------------------------------------------------------------------------------------- export


def cmd_export(args) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from batchspec.model.loading import load_tokenizer

    work = Path(args.work)
    draft = AutoModelForCausalLM.from_pretrained(work / "draft", dtype=torch.float32)
    draft = draft.to(torch.float16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*"):
        if f.name != "README.md":
            f.unlink()
    draft.save_pretrained(out)
    gen = GenerationConfig(bos_token_id=draft.config.bos_token_id, eos_token_id=draft.config.eos_token_id,
                           pad_token_id=draft.config.pad_token_id)
    gen.save_pretrained(out)
    load_tokenizer(TARGET).save_pretrained(out)
    log(f"exported to {out}: " + ", ".join(f"{f.name} {f.stat().st_size / 1e6:.2f} MB" for f in sorted(out.glob('*'))))


# --------------------------------------------------------------------------------------------------------- eval


def macs_per_token(model) -> int:
    """Weight multiply-accumulates of one decode step (every linear layer incl. the output head; no attention
    scores)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


@torch.no_grad()
def step_seconds(model, batch: int, context: int, steps: int, repeats: int) -> float:
    """Best-of-``repeats`` mean wall time of one single-token decode step over a ``context``-token cache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context + steps), generator=g)
    best = float("inf")
    for _ in range(repeats):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        for i in range(steps):
            model(input_ids=ids[:, context + i: context + i + 1], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def cmd_eval(args) -> None:
    import batchspec
    from batchspec.data import builtin_prompts
    from batchspec.prompts import encode

    torch.set_num_threads(1)
    llm = batchspec.LLM(TARGET, draft=args.draft, num_draft_tokens=args.k, batch_size=args.batch_size, device="cpu")
    target, draft = llm.target, llm.draft
    res = {"target_macs_per_token": macs_per_token(target), "draft_macs_per_token": macs_per_token(draft),
           "target_params": sum(p.numel() for p in target.parameters()),
           "draft_params": sum(p.numel() for p in draft.parameters())}
    res["macs_ratio"] = round(res["draft_macs_per_token"] / res["target_macs_per_token"], 4)
    log(f"multiply-accumulates per token: target {res['target_macs_per_token'] / 1e6:.1f} M, draft "
        f"{res['draft_macs_per_token'] / 1e6:.2f} M, ratio {res['macs_ratio']:.3f}")
    for b in args.cost_batches:
        tt = step_seconds(target, b, 128, 16, args.repeats)
        dt = step_seconds(draft, b, 128, 16, args.repeats)
        res[f"step_ms_batch{b}"] = {"target": round(tt * 1e3, 2), "draft": round(dt * 1e3, 2), "ratio": round(dt / tt, 4)}
        log(f"decode step at batch {b}: target {tt * 1e3:.2f} ms, draft {dt * 1e3:.2f} ms, ratio {dt / tt:.3f}")
    pairs = builtin_prompts()
    prompts = encode(llm.tokenizer, [t for _, t in pairs], True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=args.max_tokens))
    s = llm.stats
    res.update(k=args.k, max_tokens=args.max_tokens, prompts=len(prompts), generated=s.generated,
               mean_accepted_length=round(s.mean_accepted_length, 4),
               acceptance_rate=round(s.accepted / max(s.drafted, 1), 4), generate_seconds=round(time.perf_counter() - t0, 1))
    log(f"K={args.k}: mean accepted length {s.mean_accepted_length:.3f} over {len(prompts)} built-in prompts "
        f"({s.generated} tokens)")
    if args.check_hf:
        same = 0
        for p, o in list(zip(prompts, outs))[: args.check_hf]:
            ref = target.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False)[0, len(p):]
            same += ref.tolist() == o.token_ids
        res["identical_to_hf_generate"] = f"{same}/{min(args.check_hf, len(prompts))}"
        log(f"identical to HF generate (batch size 1): {res['identical_to_hf_generate']}")
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


# --------------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["gen", "train", "export", "all", "eval"])
    p.add_argument("--work", default=str(ROOT / "build" / "draft"))
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("gen")
    g.add_argument("--num-prompts", type=int, default=1300)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--topk", type=int, default=16)
    g.add_argument("--heldout", action=argparse.BooleanOptionalAction, default=True,
                   help="also record the target's answers to the built-in prompts (for held-out agreement only)")
    t = p.add_argument_group("train")
    t.add_argument("--hidden", type=int, default=162)
    t.add_argument("--layers", type=int, default=2, help="random-init drafts only")
    t.add_argument("--heads", type=int, default=9, help="random-init drafts only")
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--init", choices=["layers", "data", "svd"], default="layers",
                   help="layers: the target's --from-layers compressed to --hidden (see compressed_target); data/svd: "
                        "random layers, embedding from a data-weighted / plain top-SVD projection of the target head")
    t.add_argument("--from-layers", default="0,1")
    t.add_argument("--epochs", type=int, default=6)
    t.add_argument("--max-steps", type=int, default=None, help="stop early (experiments)")
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--emb-lr-scale", type=float, default=0.3)
    t.add_argument("--hard-weight", type=float, default=0.5)
    t.add_argument("--negatives", type=int, default=4096, help="sampled softmax negatives per step (0: full softmax)")
    t.add_argument("--log-every", type=int, default=20)
    p.add_argument("--out", default=str(OUT_DIR))
    e = p.add_argument_group("eval")
    e.add_argument("--draft", default="smollm2-135m-draft-model")
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--cost-batches", type=int, nargs="*", default=[1, 8])
    e.add_argument("--repeats", type=int, default=5)
    e.add_argument("--check-hf", type=int, default=0, metavar="N",
                   help="also compare the first N outputs with HF generate(do_sample=False) at batch size 1")
    e.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.stage in ("gen", "all"):
        cmd_gen(args)
    if args.stage in ("train", "all"):
        cmd_train(args)
    if args.stage in ("export", "all"):
        cmd_export(args)
    if args.stage == "all":
        log(f"all stages: {time.perf_counter() - t0:.0f} s wall")
    if args.stage == "eval":
        cmd_eval(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
