"""Replay drafting rules offline: what mean accepted length would a rule reach at fixed K, greedy?

Under greedy decoding the target's output does not depend on the drafts, so one plain run gives every reference
answer, and a rule's rounds can be replayed on it: a round drafts up to K tokens from the history so far, accepts
the ones that match the answer, and emits one more. The feature-reading head's drafts come from one teacher-forced
pass (``head_unrolled``: its d-th draft at every position, given the earlier drafts were right), so every rule built
from the head, prompt lookup's copies and an n-gram store of the target's own answers (REST-like retrieval: the most
frequent next token after the longest matching suffix, up to 6 tokens) replays in seconds. With lookup's and the
head's rules it reproduces the engine's fixed-K figures (``scripts/eval_draft.py``); the "oracle" row drafts, at each
index, whichever source is right: the most any choice among them could reach.

    python scripts/replay_drafts.py --spec-bench question.jsonl [--store build/eagle_all2] [--threads 2]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from types import SimpleNamespace

import torch
from eval_draft import specbench_prompts  # this folder's measurement script

from batchspec.training.data import chunk_files, features

STORE_N = 6


def references(target: str, prompt_sets: dict, max_tokens: int) -> dict:
    """Per set, (prompt ids, the target's greedy answer) from batchspec's plain engine."""
    import batchspec
    from batchspec.prompts import encode

    llm = batchspec.LLM(target, draft=None, batch_size=8, device="cpu")
    out = {}
    for name, texts in prompt_sets.items():
        ids = encode(llm.tokenizer, texts, True)
        answers = llm.generate(ids, batchspec.SamplingParams(max_tokens=max_tokens))
        out[name] = [(list(p), list(a.token_ids)) for p, a in zip(ids, answers)]
    return out, llm.target


@torch.no_grad()
def head_drafts(target, draft: str, refs: dict, k: int) -> dict:
    """Per set and sequence, ``[k, n]`` twice: the head's d-th draft of token t (-1 where none), teacher-forced,
    and its probability."""
    from batchspec.drafters import EagleDrafter
    from batchspec.model.loading import resolve
    from batchspec.training.head import head_unrolled

    head = EagleDrafter.load(resolve(draft, "draft"), target, copy=False)
    out = {}
    for name, pairs in refs.items():
        seqs = [p + a for p, a in pairs]
        out[name] = []
        for seq, feats in zip(seqs, features(target, seqs)):
            ids = torch.tensor(seq)[None]
            steps = head_unrolled(head.model, head.fc, head.embedding, torch.nn.functional.pad(ids[:, 1:], (0, 1)),
                                  feats[None].float(), k)
            drafts = torch.full((k, len(seq)), -1, dtype=torch.long)
            confidence = torch.zeros((k, len(seq)))
            for d, (_, logits) in enumerate(steps):  # step d at position i drafts token i + 2
                top = logits[0, :-2].softmax(-1).max(-1)
                drafts[d, 2:], confidence[d, 2:] = head.token_map[top.indices], top.values
            out[name].append((drafts, confidence))
    return out


class Store:
    """Next-token counts after every context of 1..``STORE_N`` tokens in the answers of the chunks in ``dirs``."""

    def __init__(self, dirs: list[Path]):
        self.tables = [collections.defaultdict(collections.Counter) for _ in range(STORE_N + 1)]
        for path in chunk_files(dirs):
            chunk = torch.load(path)
            for ids, start in zip(chunk["ids"], chunk["prompt_len"]):
                for i in range(max(start, 1), len(ids)):
                    for n in range(1, min(STORE_N, i) + 1):
                        self.tables[n][tuple(ids[i - n:i])][ids[i]] += 1
        self.tokens = sum(sum(c.values()) for c in self.tables[1].values())

    def next(self, hist: list[int]) -> tuple[int | None, int, float]:
        """(token, context length, share of that context's continuations) for the longest context seen."""
        for n in range(min(STORE_N, len(hist)), 0, -1):
            counts = self.tables[n].get(tuple(hist[-n:]))
            if counts:
                token, c = counts.most_common(1)[0]
                return token, n, c / sum(counts.values())
        return None, 0, 0.0


def lookup(hist: list[int], k: int) -> tuple[list[int], int]:
    """Prompt lookup's candidates (up to k) and match length, from the engine's own drafter."""
    from batchspec.drafters import PromptLookup

    seqs = SimpleNamespace(history=torch.tensor([hist]), length=torch.tensor([len(hist)]))
    drafts, n_drafts, match = PromptLookup().candidates(seqs, k)
    return drafts[0, : int(n_drafts[0])].tolist(), int(match[0])


def replay(rule, refs: dict, heads: dict, k: int) -> dict:
    """Mean accepted length (tokens per round, the bonus token included) of ``rule(hist, k, head, at)``."""
    res = {}
    for name, pairs in refs.items():
        tokens = rounds = 0
        for (prompt, answer), head in zip(pairs, heads[name]):
            pos = 0
            while pos < len(answer):
                drafts = rule(prompt + answer[:pos], k, head, len(prompt) + pos, answer[pos:])
                a = 0
                while a < min(len(drafts), len(answer) - pos) and drafts[a] == answer[pos + a]:
                    a += 1
                step = min(a + 1, len(answer) - pos)
                tokens, rounds, pos = tokens + step, rounds + 1, pos + step
        res[name] = tokens / rounds
    return res


def head_rule(copies_from: int | None = None, store: Store | None = None, unsure: float = 0.5):
    """The head's drafts. With ``copies_from``, a row whose match is that long drafts lookup's copies first, the
    head drafting on after them (the engine's learned rule settles there on these prompts). With ``store``, the
    store's token replaces the head's where the head is unsure (its probability below ``unsure``) and the store is
    not (a context of 2+ tokens whose continuations agree at least 70% of the time)."""
    def rule(hist, k, head, at, truth):
        drafts, confidence = head
        out = []
        if copies_from is not None:
            copies, n = lookup(hist, k)
            if n >= copies_from:
                out = copies
        for d in range(len(out), k):
            if at + d >= drafts.shape[1]:
                break
            token = int(drafts[d, at + d])
            if store is not None and confidence[d, at + d] < unsure:
                alt, n, share = store.next(hist + out)
                token = alt if alt is not None and n >= 2 and share >= 0.7 else token
            out.append(token)
        return out
    return rule


def lookup_rule(hist, k, head, at, truth):
    return lookup(hist, k)[0]


def store_rule(store: Store, copies_from: int | None = None):
    def rule(hist, k, head, at, truth):
        out = []
        if copies_from is not None:
            copies, n = lookup(hist, k)
            if n >= copies_from:
                out = copies
        while len(out) < k:
            token = store.next(hist + out)[0]
            if token is None:
                break
            out.append(token)
        return out
    return rule


def oracle_rule(store: Store | None):
    """At each index, whichever of the head's draft, the copy and the store's token is right (else the head's)."""
    def rule(hist, k, head, at, truth):
        out = []
        for d in range(min(k, len(truth))):
            h = hist + out
            options = [int(head[0][d, at + d])] + lookup(h, 1)[0] + ([store.next(h)[0]] if store else [])
            out.append(truth[d] if truth[d] in options else options[0])
            if out[-1] != truth[d]:
                break
        return out
    return rule


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-draft")
    p.add_argument("--spec-bench", help="Spec-Bench question.jsonl: also its 8-prompt set")
    p.add_argument("--store", action="append", default=[], help="a folder of training chunks (train-draft's gen "
                   "stage) for the n-gram store")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from batchspec.data import builtin_prompts

    sets = {"built-in": [t for _, t in builtin_prompts()]}
    if args.spec_bench:
        sets["Spec-Bench 8"] = specbench_prompts(args.spec_bench)
    refs, target = references(args.target, sets, args.max_tokens)
    heads = head_drafts(target, args.draft, refs, args.k)
    store = Store([Path(d) for d in args.store]) if args.store else None
    rules = {"prompt lookup": lookup_rule, "head": head_rule(), "head + copies (match >= 2)": head_rule(2)}
    if store is not None:
        print(f"n-gram store: {store.tokens} answer tokens")
        rules["store"] = store_rule(store)
        rules["copies (match >= 2) + store"] = store_rule(store, 2)
        rules["head + copies + store where the head is unsure"] = head_rule(2, store)
    rules["oracle (head, copy" + (", store)" if store else ")")] = oracle_rule(store)
    print(f"| rule (K={args.k}, greedy, {args.max_tokens} tokens) | " + " | ".join(sets) + " |")
    print("|---|" + "---|" * len(sets))
    for name, rule in rules.items():
        res = replay(rule, refs, heads, args.k)
        print(f"| {name} | " + " | ".join(f"{res[s]:.3f}" for s in sets) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
