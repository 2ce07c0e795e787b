"""Training data for a feature-reading head (the gen stage of ``batchspec train-draft --kind head``) and the helpers
that read it back.

The target answers the training prompts greedily through its chat template with batchspec's plain engine, in chunks
of ``--chunk`` prompts; each chunk then gets the target's final hidden states (the features the head reads) at every
position from one teacher-forced forward, stored in float16 as ``chunkNNN.pt`` in the work folder. A chunk on disk is
never generated again, so an interrupted gen stage resumes where it stopped. ``gen-settings.json`` records what the
chunks were made from, so a rerun with other prompts or settings is refused instead of mixing two data sets.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch

from ..progress import Progress

SETTINGS = "gen-settings.json"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` through a temporary file, so an interrupted write never leaves a truncated chunk behind."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------------- prompts


def prompt_pairs(source: str, n: int | None, seed: int, tokenizer=None, passages: list[str] = ()) -> list[tuple]:
    """``(category, prompt)`` pairs: ``templates`` (``training_prompts``: ``n`` of them), ``broad``
    (``broad_prompts``, with the answers stored in the gen folders ``passages`` as texts) or a prompt file (JSONL with
    ``turns[0]`` or plain text, one a line; its first ``n``, or all), category ``file``. The generated sets are checked
    against the built-in evaluation prompts; an empty set raises ``ValueError``."""
    from ..prompts import read_prompts
    from .prompts import broad_prompts, check_held_out, held_out_texts, training_prompts

    if source in ("templates", "broad"):
        held = held_out_texts()
        if source == "templates":
            pairs = training_prompts(n, seed, held)
        else:
            texts = answer_passages(tokenizer, [Path(d) for d in passages])
            log(f"gen: broad prompts, {len(texts)} passages from earlier answers")
            pairs = broad_prompts(n, seed, held, texts)
        check_held_out(pairs, held)
    else:
        pairs = [("file", t) for _, t in read_prompts(source)][:n]
    if not pairs:
        raise ValueError(f"no prompts in {source}; give a file with one prompt a line (or JSONL with turns[0])")
    return pairs


def check_settings(work: Path, settings: dict) -> None:
    """Refuse to add data to ``work`` made from other prompts or settings than the data already there; record the
    settings of a new folder."""
    path = work / SETTINGS
    if path.is_file():
        have = json.loads(path.read_text())
        diff = sorted(k for k in set(have) | set(settings) if have.get(k) != settings.get(k))
        if diff:
            was = ", ".join(f"{k}: {have.get(k)!r}" for k in diff)
            raise ValueError(f"--work {work} holds data made with other settings ({was}); use another --work, the same "
                             f"flags, or delete {path} to add to it anyway")
    else:
        path.write_text(json.dumps(settings, indent=1))


# --------------------------------------------------------------------------------------------------------- gen


@torch.no_grad()
def features(model, seqs: list[list[int]], max_tokens: int = 8192) -> list[torch.Tensor]:
    """The target's final (normalised) hidden states at every position of each sequence, float16 on the CPU, in
    groups of similar length padded on the right (causal attention: right padding changes nothing before it)."""
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
        hidden = model.model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).last_hidden_state
        for n, r in enumerate(rows):
            out[r] = hidden[n, :len(seqs[r])].to("cpu", torch.float16).clone()
        i = j
    return out


def chunk_path(work: Path, index: int) -> Path:
    return work / f"chunk{index:03d}.pt"


def generate_chunks(target, pairs: list[tuple], work: Path, chunk: int, chunks: int | None, max_new_tokens: int,
                    batch: int, seed: int, progress: bool = True, device: str = "cpu",
                    seconds: float | None = None) -> int:
    """The gen stage of a head: the chunks of ``pairs`` (shuffled with ``seed``, so every chunk mixes the
    categories; the first ``chunks`` of them, or all) not yet in ``work``, each the target's greedy answers (plain
    engine, batch ``batch``, continuous batching, on ``device``) and their features. The target loads only when a
    chunk is missing. After ``seconds``, no new chunk starts (the first always does; a later run does the rest).
    Returns the number of chunks written."""
    pairs = list(pairs)
    random.Random(seed).shuffle(pairs)  # every chunk mixes the categories
    starts = list(range(0, len(pairs), chunk))[:chunks]
    todo = [c for c in starts if not chunk_path(work, c // chunk).exists()]
    log(f"gen: {len(starts) - len(todo)} of {len(starts)} chunks already in {work}, {len(todo)} to generate")
    if not todo:
        return 0
    from ..api import LLM
    from ..params import SamplingParams
    from ..prompts import encode

    llm = LLM(target, batch_size=batch, scheduler="continuous", device=device)
    if llm.tokenizer is None:
        raise ValueError(f"the target {target!r} has no tokenizer to encode the prompts")
    ids = encode(llm.tokenizer, [t for _, t in pairs], True)
    params = SamplingParams(max_tokens=max_new_tokens)
    t0 = time.perf_counter()
    total = 0
    with Progress(progress, sum(len(pairs[c:c + chunk]) for c in todo), "gen: answering") as bar:

        def answered(index, new_tokens, finished):
            if finished:
                bar.advance()

        for n, c in enumerate(todo):
            if n and seconds is not None and time.perf_counter() - t0 >= seconds:
                log(f"gen: {seconds:g} s reached, {len(todo) - n} chunks left for a later run")
                return n
            outs = llm.generate(ids[c:c + chunk], params, on_tokens=answered)
            bar.describe("gen: features")
            seqs = [o.prompt_token_ids + o.token_ids for o in outs]
            feats = features(llm.target, seqs)
            save_atomic({"categories": [k for k, _ in pairs[c:c + chunk]], "prompt_len": [len(o.prompt_token_ids)
                         for o in outs], "ids": seqs, "hidden": feats}, chunk_path(work, c // chunk))
            bar.describe("gen: answering")
            total += sum(len(o.token_ids) for o in outs)
            log(f"gen: chunk {c // chunk} ({min(c + chunk, len(pairs))}/{len(pairs)} prompts), "
                f"{total} answer tokens this run, {time.perf_counter() - t0:.0f} s")
    return len(todo)


def answer_passages(tokenizer, dirs: list[Path], chars: int = 500) -> list[str]:
    """The target's answers stored in the chunks of ``dirs``, each cut to whole sentences within ``chars``."""
    out = []
    for d in dirs:
        for path in sorted(d.glob("*chunk*.pt")):
            c = torch.load(path, map_location="cpu")
            for ids, p in zip(c["ids"], c["prompt_len"]):
                text = tokenizer.decode(ids[p:], skip_special_tokens=True).strip().replace('"', "'")
                cut = text[:chars]
                end = max(cut.rfind(". "), cut.rfind(".\n"))
                if end > 100:
                    out.append(cut[:end + 1])
    return out


# --------------------------------------------------------------------------------------------------------- reading


def chunk_files(dirs: list[Path]) -> list[Path]:
    """The chunks of ``dirs``: each folder's in name order, the folders in the order given."""
    return [p for d in dirs for p in sorted(Path(d).glob("*chunk*.pt"))]


def load_chunks(dirs: list[Path], seen: set | None = None):
    """The sequences, features and prompt lengths of every chunk in ``dirs`` not in ``seen`` (which is updated)."""
    seqs, feats, starts = [], [], []
    seen = set() if seen is None else seen
    for path in chunk_files(dirs):
        if str(path) in seen:
            continue
        seen.add(str(path))
        d = torch.load(path, map_location="cpu")
        seqs += [torch.tensor(x) for x in d["ids"]]
        feats += d["hidden"]
        starts += d["prompt_len"]
    return seqs, feats, starts


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
