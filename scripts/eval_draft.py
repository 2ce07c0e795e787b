"""Train the feature-reading draft head (``batchspec.drafters.eagle``) for the ``smollm2-135m`` target, on CPU.

Stages (each reads the previous one's output from ``--work``):

1. ``gen``: the target answers training prompts (``scripts/draft_prompts.py``: written for this, disjoint from the
   built-in evaluation prompts) greedily through its chat template with batchspec's plain engine, in chunks; each
   chunk then gets the target's final hidden states (the features the head reads) at every position from one
   teacher-forced forward, stored in float16. Chunks already on disk are kept, so the stage resumes.
2. ``train``: the head (``fc`` over [token embedding, feature], one Llama decoder layer, the target's own norm and a
   vocabulary-restricted copy of its output head) learns to predict the next feature and the target's next-token
   distribution, with the target's embedding and head frozen.
3. ``export``: the head's weights, config and card into ``src/batchspec/data/<name>``.
4. ``eval``: mean accepted length at K draft tokens on the built-in prompts and the 8 Spec-Bench prompts, and the
   head's cost per drafted token relative to a target decode step.
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

from draft_prompts import HeldOut, broad_prompts, training_prompts  # noqa: E402

TARGET = "smollm2-135m"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def held_out_texts() -> list[str]:
    from batchspec.data import builtin_prompts

    return [t for _, t in builtin_prompts()]


# --------------------------------------------------------------------------------------------------------- gen


@torch.no_grad()
def features(model, seqs: list[list[int]], max_tokens: int = 8192) -> list[torch.Tensor]:
    """The target's final (normalised) hidden states at every position of each sequence, float16, in groups of
    similar length padded on the right (causal attention: right padding changes nothing before it)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        width = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max_tokens:
            j += 1
        j = max(j, i + 1)
        rows = order[i:j]
        width = max(len(seqs[r]) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for n, r in enumerate(rows):
            ids[n, :len(seqs[r])] = torch.tensor(seqs[r])
            mask[n, :len(seqs[r])] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for n, r in enumerate(rows):
            out[r] = hidden[n, :len(seqs[r])].to(torch.float16).clone()
        i = j
    return out


def answer_passages(tokenizer, dirs: list[Path], chars: int = 500) -> list[str]:
    """The target's answers stored in the chunks of ``dirs``, each cut to whole sentences within ``chars``."""
    out = []
    for d in dirs:
        for path in sorted(d.glob("*chunk*.pt")):
            c = torch.load(path)
            for ids, p in zip(c["ids"], c["prompt_len"]):
                text = tokenizer.decode(ids[p:], skip_special_tokens=True).strip().replace('"', "'")
                cut = text[:chars]
                end = max(cut.rfind(". "), cut.rfind(".\n"))
                if end > 100:
                    out.append(cut[:end + 1])
    return out


def cmd_gen(args) -> None:
    import batchspec
    from batchspec.prompts import encode

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    held = held_out_texts()
    llm = batchspec.LLM(TARGET, batch_size=args.batch, scheduler="continuous")
    if args.prompts == "broad":
        passages = answer_passages(llm.tokenizer, [Path(d) for d in args.passages])
        pairs = broad_prompts(args.num_prompts, args.seed, held, passages)
        log(f"gen: broad prompts, {len(passages)} passages from earlier answers")
    else:
        pairs = training_prompts(args.num_prompts, args.seed, held)
    guard = HeldOut(held)
    assert not any(guard.overlaps(t) for _, t in pairs), "training prompts overlap the built-in prompts"
    random.Random(args.seed).shuffle(pairs)  # every chunk mixes the categories
    ids = encode(llm.tokenizer, [t for _, t in pairs], True)
    params = batchspec.SamplingParams(max_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    total = 0
    for c in range(0, len(pairs), args.chunk)[: args.chunks]:
        path = work / f"chunk{c // args.chunk:03d}.pt"
        if path.exists():
            continue
        outs = llm.generate(ids[c:c + args.chunk], params)
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        feats = features(llm.target, seqs)
        torch.save({"categories": [k for k, _ in pairs[c:c + args.chunk]], "prompt_len": [len(o.prompt_token_ids)
                    for o in outs], "ids": seqs, "hidden": feats}, path)
        total += sum(len(o.token_ids) for o in outs)
        log(f"gen: chunk {c // args.chunk} ({min(c + args.chunk, len(pairs))}/{len(pairs)} prompts), "
            f"{total} answer tokens this run, {time.perf_counter() - t0:.0f} s")


# --------------------------------------------------------------------------------------------------------- train


def load_chunks(work: Path, seen: set | None = None):
    """The sequences of every chunk in ``work`` not in ``seen`` (which is updated)."""
    seqs, feats, starts = [], [], []
    seen = set() if seen is None else seen
    for path in sorted(work.glob("*chunk*.pt")):
        if path.name in seen:
            continue
        seen.add(path.name)
        d = torch.load(path)
        seqs += [torch.tensor(x) for x in d["ids"]]
        feats += d["hidden"]
        starts += d["prompt_len"]
    return seqs, feats, starts


def fmt(xs: list[float]) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def token_map_of(seqs, starts, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` tokens the target writes most often in its answers (ids ascending)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s, p in zip(seqs, starts):
        counts += torch.bincount(s[p:], minlength=vocab)
    return counts.argsort(descending=True)[:size].sort().values


def batches(lengths: list[int], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index groups of similar length, at most ``max_tokens`` padded tokens each, in random order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(rows, seqs, feats, starts, where):
    """Right-padded ``[R, n]`` pairs: next tokens, input features, target features, head-row labels (-100 outside
    the map and on padding), and answer / padding masks."""
    n = max(len(seqs[r]) for r in rows) - 1
    R, H = len(rows), feats[rows[0]].shape[-1]
    nxt = torch.zeros((R, n), dtype=torch.long)
    f_in = torch.zeros((R, n, H))
    f_out = torch.zeros((R, n, H))
    label = torch.full((R, n), -100, dtype=torch.long)
    real = torch.zeros((R, n), dtype=torch.bool)
    answer = torch.zeros((R, n), dtype=torch.bool)
    for j, r in enumerate(rows):
        s, f, m = seqs[r], feats[r].float(), len(seqs[r]) - 1
        nxt[j, :m] = s[1:]
        f_in[j, :m] = f[:-1]
        f_out[j, :m] = f[1:]
        label[j, : m - 1] = where[s[2:]]
        real[j, :m] = True
        answer[j, max(starts[r] - 2, 0): m - 1] = True  # pair i predicts token i+2: an answer token from here on
    return nxt, f_in, f_out, label, real, answer


def cmd_train(args) -> None:
    from batchspec.model.loading import load_model
    from batchspec.training.head import build_head, head_unrolled

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    work = Path(args.work)
    target = load_model(TARGET, torch.float32, "cpu")
    seen: set = set()
    seqs, feats, starts = load_chunks(work, seen)
    if not seqs:
        raise SystemExit(f"no data in {work}: run the gen stage first")
    vocab = target.config.vocab_size
    init = torch.load(args.init) if args.init else None
    token_map = init["token_map"] if init else token_map_of(seqs, starts, vocab, args.vocab)
    where = torch.full((vocab,), -100, dtype=torch.long)
    where[token_map] = torch.arange(len(token_map))
    answers = sum(len(s) - p for s, p in zip(seqs, starts))
    covered = sum(int((where[s[p:]] >= 0).sum()) for s, p in zip(seqs, starts))
    log(f"data: {len(seqs)} sequences, {sum(map(len, seqs))} tokens ({answers} answer tokens); head of "
        f"{len(token_map)} tokens covers {covered / answers:.4f} of answer tokens")
    model, fc = build_head(target, token_map, None if args.random_layer else args.copy_layer)
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
    t0 = time.perf_counter()

    def losses(rows, noise: float):
        """The loss summed over ``--depth`` drafting steps, and each step's top-1 agreement at answer positions."""
        nxt, f_in, f_out, label, real, answer = collate(rows, seqs, feats, starts, where)
        if noise:
            f_in = f_in + (torch.rand_like(f_in) - 0.5) * 2 * noise
        with torch.no_grad():
            teacher = (f_out @ head_w.T).log_softmax(-1)
        total, hits = 0.0, []
        for d, (states, logits) in enumerate(head_unrolled(model, fc, emb, nxt, f_in, args.depth)):
            logp = logits.log_softmax(-1)
            soft = -(teacher.exp() * logp).sum(-1)
            reg = F.smooth_l1_loss(states, f_out, reduction="none").mean(-1)
            hard = F.cross_entropy(logits.flatten(0, 1), label.flatten(), reduction="none",
                                   ignore_index=-100).view_as(soft)
            w = real.clone()
            w[:, :d] = False  # step d at position i starts from the real feature f_(i-d)
            ans = answer & w
            a = (ans & (label >= 0)).float()
            w = w.float()
            total = total + ((args.reg * reg + args.soft * soft) * w).sum() / w.sum() + \
                args.hard * (hard * a).sum() / a.sum().clamp(min=1)
            hits.append(float(((logits.argmax(-1) == teacher.argmax(-1)) & ans).sum() / ans.sum().clamp(min=1)))
        return total / args.depth, hits

    def plan():
        """Epochs of batches; with ``--follow``, chunks the gen stage wrote meanwhile join at each epoch."""
        epoch = 0
        while True:
            if args.follow and epoch:
                more = load_chunks(work, seen)
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

    save = Path(args.save) if args.save else work / "head.pt"
    for step, rows in zip(range(total), plan()):
        loss, hit = losses(rows, args.noise)
        opt.zero_grad()
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == total - 1:
            log(f"step {step}/{total} loss {loss.item():.4f} top-1 {fmt(hit)} grad {gnorm.item():.2f} "
                f"lr {sched.get_last_lr()[0]:.2e} {time.perf_counter() - t0:.0f} s")
        if (step + 1) % args.eval_every == 0 or step == total - 1:
            evaluate()
            checkpoint(step + 1)
    if not total:
        evaluate()
    log(f"saved {save}: {checkpoint(total)}")


def portable(info):
    """``info`` with paths inside this checkout written relative to it (a card names no machine's folders)."""
    if isinstance(info, dict):
        return {k: portable(v) for k, v in info.items()}
    if isinstance(info, str) and info.startswith(str(ROOT) + "/"):
        return info[len(str(ROOT)) + 1:]
    return info


def cmd_export(args) -> None:
    from batchspec.drafters.eagle import EagleDrafter
    from batchspec.model.loading import load_model
    from batchspec.training.head import build_head

    work, out = Path(args.work), Path(args.out)
    ck = torch.load(args.save or work / "head.pt")
    target = load_model(TARGET, torch.float32, "cpu")
    model, fc = build_head(target, ck["token_map"], None)
    model.load_state_dict(ck["model"])
    fc.load_state_dict(ck["fc"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.name != "README.md":
            old.unlink()
    model.half()
    fc.half()
    model.generation_config.eos_token_id = target.generation_config.eos_token_id
    EagleDrafter.save(out, model, fc, ck["token_map"], portable(ck["info"]))
    from batchspec.model.loading import load_tokenizer

    load_tokenizer(TARGET).save_pretrained(out)
    log(f"exported to {out}")


# --------------------------------------------------------------------------------------------------------- eval


def macs_per_token(modules) -> int:
    return sum(m.weight.numel() for mod in modules for m in mod.modules() if isinstance(m, torch.nn.Linear))


@torch.no_grad()
def step_costs(llm, batch_sizes=(1, 8), context: int = 256, repeats: int = 40) -> dict:
    """Measured time of one drafting step (a draft model's decode step; a head's ``fc`` and layer over one pair per
    row, with its restricted output head) against one target decode step (one token per row), both through their
    runners over caches of ``context`` positions, interleaved; medians of ``repeats`` pairs."""
    from batchspec.model.kv import new_cache
    from batchspec.model.runner import Runner

    d, target = llm.drafter, llm.target
    runner, eagle = Runner(target), d.name == "eagle"
    out = {}
    for b in batch_sizes:
        ids = torch.randint(3, 1000, (b, context + 1))
        pos = torch.arange(context)[None].expand(b, -1)
        tc, dc = new_cache(target), new_cache(d.model)
        feats = runner.forward(tc, ids[:, :context], pos, None, 1, "all").hidden
        extra = dict(hidden=True, embeds=d._inputs(ids[:, 1:], feats)) if eagle else {}
        d.runner.forward(dc, ids[:, :context], pos, None, 1, **extra)
        times = {"target": [], "draft": []}
        for r in range(repeats + 3):
            n = context + r
            p1, seen = torch.full((b, 1), n), torch.ones((b, n + 1), dtype=torch.bool)
            t0 = time.perf_counter()
            runner.forward(tc, ids[:, -1:], p1, seen, 1)
            t1 = time.perf_counter()
            extra = dict(hidden=True, embeds=d._inputs(ids[:, -1:], feats[:, -1:])) if eagle else {}
            d.runner.forward(dc, ids[:, -1:], p1, seen, 1, **extra)
            t2 = time.perf_counter()
            if r >= 3:  # warm-up
                times["target"].append(t1 - t0)
                times["draft"].append(t2 - t1)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        out[f"batch_{b}"] = {"target_step_ms": round(med["target"] * 1e3, 3), "draft_step_ms": round(
            med["draft"] * 1e3, 3), "ratio": round(med["draft"] / med["target"], 4)}
        log(f"batch {b}: target decode step {med['target'] * 1e3:.2f} ms, drafting step {med['draft'] * 1e3:.2f} ms, "
            f"ratio {med['draft'] / med['target']:.3f}")
    return out


def specbench_prompts(path: str) -> list[str]:
    recs = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r["turns"][0] for c in ("summarization", "rag", "qa", "translation")
            for r in [r for r in recs if r.get("category") == c][:2]]


@torch.no_grad()
def cmd_eval(args) -> None:
    import batchspec
    from batchspec.data import builtin_prompts
    from batchspec.prompts import encode

    torch.set_num_threads(args.threads)
    draft = args.draft
    if args.no_copy:  # the head alone, without prompt lookup's copies
        from batchspec.drafters import EagleDrafter
        from batchspec.model.loading import load_model, resolve

        draft = EagleDrafter.load(resolve(args.draft, "draft"), load_model(TARGET, None, "cpu", "target"), copy=False)
    llm = batchspec.LLM(TARGET, draft=draft, num_draft_tokens=args.k, batch_size=args.batch_size,
                        speculation="fixed", device="cpu")
    d = llm.drafter
    res = {"draft": args.draft, "kind": d.name, "copies": getattr(d, "copy", None) is not None, "k": args.k,
           "max_tokens": args.max_tokens}
    if d.name == "eagle":
        res["draft_macs_per_token"] = macs_per_token([d.model, d.fc])  # fc, the layer and the restricted head
        res["head_tokens"] = len(d.token_map)
    elif d.name == "model":
        res["draft_macs_per_token"] = macs_per_token([d.model])
    if "draft_macs_per_token" in res:  # a model-free drafter (prompt lookup) has none
        res["target_macs_per_token"] = macs_per_token([llm.target])
        res["macs_ratio"] = round(res["draft_macs_per_token"] / res["target_macs_per_token"], 4)
        log(f"multiply-accumulates per token: target {res['target_macs_per_token'] / 1e6:.1f} M, draft "
            f"{res['draft_macs_per_token'] / 1e6:.2f} M, ratio {res['macs_ratio']:.3f}")
    if d.name in ("eagle", "model"):
        res["step_costs"] = step_costs(llm)
    sets = [("builtin", encode(llm.tokenizer, [t for _, t in builtin_prompts()], True))]
    if args.spec_bench:
        sets.append(("spec_bench_8", encode(llm.tokenizer, specbench_prompts(args.spec_bench), True)))
    for name, prompts in sets:
        llm.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=args.max_tokens))
        s = llm.stats
        res[name] = {"prompts": len(prompts), "generated": s.generated,
                     "mean_accepted_length": round(s.mean_accepted_length, 4),
                     "acceptance_rate": round(s.accepted / max(s.drafted, 1), 4),
                     "seconds": round(time.perf_counter() - t0, 1)}
        log(f"{name}: K={args.k} mean accepted length {s.mean_accepted_length:.3f} ({s.generated} tokens)")
        if args.check_hf:
            same = sum(llm.target.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False)[
                0, len(p):].tolist() == o.token_ids for p, o in list(zip(prompts, outs))[: args.check_hf])
            res[name]["identical_to_hf_generate"] = f"{same}/{min(args.check_hf, len(prompts))}"
            log(f"{name}: identical to HF generate (batch size 1): {res[name]['identical_to_hf_generate']}")
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["gen", "train", "export", "eval"])
    p.add_argument("--work", default=str(ROOT / "build" / "eagle"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    g = p.add_argument_group("gen")
    g.add_argument("--num-prompts", type=int, default=4000)
    g.add_argument("--chunk", type=int, default=250)
    g.add_argument("--chunks", type=int, default=None, help="stop after the first N chunks (default: all)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--prompts", choices=["templates", "broad"], default="templates",
                   help="templates: the first set of draft_prompts.py; broad: any topic under any request")
    g.add_argument("--passages", nargs="*", default=[], help="work folders whose answers become broad prompts' texts")
    t = p.add_argument_group("train")
    t.add_argument("--vocab", type=int, default=8192, help="tokens the head scores (the most frequent answers)")
    t.add_argument("--copy-layer", type=int, default=-1, help="target layer that initialises the head's layer")
    t.add_argument("--random-layer", action="store_true", help="random initialisation instead")
    t.add_argument("--depth", type=int, default=1,
                   help="drafting steps trained at every position (training-time test: steps after the first read "
                        "the head's own predicted features)")
    t.add_argument("--init", default=None, help="a head.pt to continue from (its token map is kept)")
    t.add_argument("--save", default=None, help="where the head goes (default: head.pt in --work)")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--max-steps", type=int, default=None, help="steps in all (default: --epochs over the data)")
    t.add_argument("--follow", action="store_true", help="add chunks written by a running gen stage each epoch")
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--noise", type=float, default=0.2, help="uniform noise added to input features (+-)")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--reg", type=float, default=1.0, help="weight of the feature regression (smooth L1)")
    t.add_argument("--soft", type=float, default=0.1, help="weight of the soft cross-entropy on the target's scores")
    t.add_argument("--hard", type=float, default=0.5, help="weight of the cross-entropy on the target's tokens")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "src" / "batchspec" / "data" / "smollm2-135m-draft"),
                   help="export: the checkpoint folder (its README.md, the model card, is kept)")
    e = p.add_argument_group("eval")
    e.add_argument("--draft", default="smollm2-135m-draft")
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--max-tokens", type=int, default=128)
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl: also the 8-prompt set")
    e.add_argument("--check-hf", type=int, default=0, metavar="N")
    e.add_argument("--json", default=None)
    e.add_argument("--no-copy", action="store_true", help="a head drafts alone, without prompt lookup's copies")
    args = p.parse_args(argv)
    {"gen": cmd_gen, "train": cmd_train, "export": cmd_export, "eval": cmd_eval}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
