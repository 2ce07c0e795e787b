"""The small draft model (``batchspec train-draft --kind model``): a ``LlamaForCausalLM`` with the target's
vocabulary and tokenizer, distilled from the target on CPU.

1. gen (``gen_records``): the target answers the training prompts greedily through its chat template; every answer
   token is stored with the target's top-k log-probabilities at that step. One file per group of prompts (a category
   of a generated set, ``--chunk`` prompts of a file), so an interrupted gen stage resumes; with ``--heldout`` also
   the answers to the built-in prompts (held-out agreement only).
2. train (``train_model``): the draft, whose weights start from the target's (``compressed_target``: its first
   layers with the residual stream compressed) or from a projection of its output embedding, is trained on those
   sequences: soft cross-entropy on the target's top-k distribution plus hard cross-entropy on its greedy token, at
   answer positions only. Its state is kept after every epoch, from which the same command resumes.
3. export (``export_model``): float16 safetensors, config, generation config and the tokenizer.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..progress import Progress
from .data import log, save_atomic
from .head import load_resume, resume_path, settings_of


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


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
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=nxt_pos[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]
        nxt_pos = nxt_pos + 1
    return [(a, torch.stack(lp), torch.stack(ix)) for a, lp, ix in zip(answers, lps, idxs)]


def generate(model, tok, texts: list[str], max_new: int, batch: int, topk: int, label: str, bar=None) -> list[dict]:
    """Greedy answers (through the chat template) with the target's top-k log-probs, one dict per text; ``bar`` (a
    ``Progress``) advances by each batch's prompts."""
    from ..prompts import encode

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    if pad is None or pad >= model.config.vocab_size:  # a token the model lacks: any id will do, padding is masked
        pad = 0
    prompts = encode(tok, texts, True)
    order = sorted(range(len(texts)), key=lambda i: len(prompts[i]))
    out: list[dict | None] = [None] * len(texts)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        for r, (ans, lp, ix) in zip(rows, greedy_rows(model, [prompts[r] for r in rows], max_new, topk, eos, pad)):
            out[r] = {"prompt": prompts[r], "answer": ans, "lp": lp, "idx": ix}
        done = min(start + batch, len(order))
        if bar is not None:
            bar.advance(len(rows))
        toks = sum(len(o["answer"]) for o in out if o is not None)
        log(f"{label}: {done}/{len(order)} prompts, {toks} answer tokens, {time.perf_counter() - t0:.0f} s")
    return out


def record_files(work: Path) -> list[Path]:
    return sorted(work.glob("records*.pt"))


def gen_records(args, pairs: list[tuple]) -> int:
    """The gen stage of a draft model: the target's greedy answers to ``pairs`` with its top-``args.topk``
    log-probabilities, one ``recordsNNN.pt`` per group (``groups``) not yet in ``args.work``, and with
    ``args.heldout`` its answers to the built-in prompts (``heldout.pt``). The target loads only when a file is
    missing. Returns the number of files written."""
    from ..model.loading import load_model, load_tokenizer
    from .prompts import held_out_texts

    torch.set_num_threads(args.threads)
    seed_all(args.seed)
    work = Path(args.work)
    groups = list(prompt_groups(pairs, args.chunk).items())
    todo = [i for i in range(len(groups)) if not (work / f"records{i:03d}.pt").exists()]
    held = held_out_texts() if args.heldout and not (work / "heldout.pt").exists() else []
    log(f"gen: {len(groups) - len(todo)} of {len(groups)} groups of prompts already in {work}, {len(todo)} to "
        "generate" + (", and the held-out answers" if held else ""))
    if not todo and not held:
        return 0
    model = load_model(args.target, torch.float32, "cpu")
    tok = load_tokenizer(args.target)
    with Progress(True, len(held) + sum(len(groups[i][1]) for i in todo), "gen: answering") as bar:
        if held:
            data = generate(model, tok, held, args.max_new_tokens, args.batch, args.topk, "held-out", bar)
            save_atomic({"records": data, "categories": None}, work / "heldout.pt")
        t0 = time.perf_counter()
        for i in todo:
            cat, texts = groups[i]
            recs = generate(model, tok, texts, args.max_new_tokens, args.batch, args.topk, cat, bar)
            save_atomic({"records": recs, "category": cat, "prompts": texts}, work / f"records{i:03d}.pt")
    records = load_records(work)
    info = {"prompts": len(records), "answer_tokens": sum(len(r["answer"]) for r in records),
            "prompt_tokens": sum(len(r["prompt"]) for r in records), "seconds": round(time.perf_counter() - t0, 1),
            "max_new_tokens": args.max_new_tokens, "topk": args.topk, "seed": args.seed}
    (work / "gen.json").write_text(json.dumps(info, indent=1))
    log(f"gen done: {info}")
    return len(todo) + bool(held)


def prompt_groups(pairs: list[tuple], chunk: int) -> dict[str, list[str]]:
    """The prompts of each generate call and file: a generated set's by category, in order of first appearance
    (answers of similar length in one batch), a prompt file's (category ``file``) in runs of ``chunk``."""
    groups: dict[str, list[str]] = {}
    for n, (cat, text) in enumerate(pairs):
        groups.setdefault(f"part{n // chunk:03d}" if cat == "file" else cat, []).append(text)
    return groups


def load_records(work: Path) -> list[dict]:
    """Every record of the gen stage's files in ``work``, in group order."""
    return [r for path in record_files(work) for r in torch.load(path)["records"]]


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
    if args.model_init == "layers":
        return compressed_target(target, records, args)
    cfg = draft_config(target.config, args.hidden, args.layers, args.heads, args.intermediate)
    draft = LlamaForCausalLM(cfg)
    emb = projected_embedding(target, args.hidden, records if args.model_init == "data" else None)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(emb)
    draft.tie_weights()
    return draft


# --------------------------------------------------------------------------------------------------------- train


def record_batches(records, max_tokens: int, rng: random.Random):
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


def collate_records(records, rows, pad: int):
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
    for rows in record_batches(records, max_tokens, random.Random(0)):
        ids, pos, _, _, hard = collate_records(records, rows, pad)
        hidden = draft.model(input_ids=ids).last_hidden_state
        pred = draft.lm_head(hidden.reshape(-1, hidden.shape[-1])[pos]).argmax(-1)
        hit += int((pred == hard).sum())
        tot += len(hard)
    draft.train()
    return hit / max(tot, 1)


def train_model(args) -> dict:
    """The train stage of a draft model: build the draft (``build_draft``), train it on the records in
    ``args.work`` and save it (float32) into the folder ``args.save``, with ``train.json`` beside the records.
    After every epoch its state (optimizer included) goes to ``resume_path(args.save)``, from which the same command
    resumes. Returns the info."""
    from ..model.loading import load_model

    torch.set_num_threads(args.threads)
    work, save = Path(args.work), Path(args.save)
    resume = load_resume(resume_path(save), args)
    records = load_records(work)
    if not records:
        raise ValueError(f"no gen records in {work}: run the gen stage first")
    heldout = torch.load(work / "heldout.pt")["records"] if (work / "heldout.pt").exists() else None
    target = load_model(args.target, torch.float32, "cpu")
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
    epochs = [record_batches(records, args.batch_tokens, rng) for _ in range(args.epochs)]
    total = sum(len(e) for e in epochs)
    if args.max_steps:
        total = min(total, args.max_steps)
    warm = max(1, int(0.03 * total))
    base = [g["lr"] for g in opt.param_groups]
    log(f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.2f} M params; {len(records)} sequences, "
        f"{args.epochs} epochs, {total} steps")
    t0, step, ema, first_epoch = time.perf_counter(), 0, None, 0
    if resume is not None:
        draft.load_state_dict(resume["draft"])
        opt.load_state_dict(resume["opt"])
        gen.set_state(resume["gen"])
        step, ema, first_epoch = resume["step"], resume["ema"], resume["epoch"]
        t0 -= resume["seconds"]
        log(f"resuming after epoch {first_epoch}, step {step} ({resume_path(save)})")
    elif heldout is not None:
        log(f"held-out agreement at init {agreement(draft, heldout, pad):.3f}")
    try:
        with Progress(True, total, "training the draft model") as bar:
            bar.update(step)
            for ep, plan in enumerate(epochs):
                if ep < first_epoch:
                    continue
                for rows in plan:
                    if step >= total:
                        break
                    scale = min(1.0, (step + 1) / warm) * (0.5 * (1 + math.cos(math.pi * step / total)) * 0.9 + 0.1)
                    for g, b in zip(opt.param_groups, base):
                        g["lr"] = b * scale
                    loss, agree = loss_fn(draft, collate_records(records, rows, pad), args.hard, args.negatives, gen)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
                    opt.step()
                    step += 1
                    bar.advance()
                    ema = float(agree) if ema is None else 0.98 * ema + 0.02 * float(agree)
                    if step % args.log_every == 0 or step == total:
                        bar.describe(f"training the draft model: loss {float(loss.detach()):.3f}")
                        log(f"epoch {ep + 1} step {step}/{total} loss {float(loss.detach()):.3f} train agreement (ema) "
                            f"{ema:.3f} {time.perf_counter() - t0:.0f} s")
                if heldout is not None:
                    log(f"epoch {ep + 1}: held-out agreement {agreement(draft, heldout, pad):.3f}")
                if ep + 1 < len(epochs) and step < total:
                    save_atomic({"epoch": ep + 1, "step": step, "ema": ema, "draft": draft.state_dict(),
                                 "opt": opt.state_dict(), "gen": gen.get_state(), "seconds": time.perf_counter() - t0,
                                 "settings": settings_of(args)}, resume_path(save))
    except KeyboardInterrupt:
        state = resume_path(save)
        how = f"the same command resumes from the state in {state}" if state.is_file() else \
            "no epoch done yet; the same command starts over"
        log(f"interrupted at step {step}: {how}")
        raise
    wall = time.perf_counter() - t0
    draft.save_pretrained(save)
    info = {"steps": total, "epochs": args.epochs, "seconds": round(wall, 1), "args": vars(args),
            "train_answer_tokens": sum(len(r["answer"]) for r in records)}
    if heldout is not None:
        info["heldout_agreement"] = round(agreement(draft, heldout, pad), 4)
    (work / "train.json").write_text(json.dumps(info, indent=1, default=str))
    resume_path(save).unlink(missing_ok=True)
    log(f"train done in {wall:.0f} s: {info.get('heldout_agreement')}")
    return info


# --------------------------------------------------------------------------------------------------------- export


def export_model(save: Path, out: Path, tokenizer) -> None:
    """Write the trained draft in ``save`` as a draft folder ``batchspec.LLM(target, draft=out)`` loads: float16
    safetensors, config, generation config and the target's tokenizer. Files already in ``out`` go, except a
    README.md (a model card)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    draft = AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32)
    draft = draft.to(torch.float16)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*"):
        if f.name != "README.md" and f.is_file():
            f.unlink()
    draft.save_pretrained(out)
    gen = GenerationConfig(bos_token_id=draft.config.bos_token_id, eos_token_id=draft.config.eos_token_id,
                           pad_token_id=draft.config.pad_token_id)
    gen.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"exported to {out}: " + ", ".join(f"{f.name} {f.stat().st_size / 1e6:.2f} MB" for f in sorted(out.glob('*'))))
