"""A draft head that reads the target's features (EAGLE, Li et al. 2024, arXiv 2401.15077), with a vocabulary-
restricted output head (FR-Spec, arXiv 2502.14856).

The target's final hidden state at position i (its *feature* f_i, what its head reads to predict token i+1) and the
embedding of token i+1 go through ``fc`` into one Llama decoder layer, whose normalised output predicts f_(i+1); the
head scores only the ``N`` most frequent tokens (``token_map``: head row -> token id). Drafting feeds the predicted
feature back in with the drafted token.

Its cache holds one slot per *pair* (f_i, x_(i+1)), filed under position i and token x_i, so it obeys the same
invariants as the target's: at rest it holds positions 0..processed-1 of the row's history. The verification forward
returns the target's features (``TargetOutput.hidden``); the state keeps the last ``W`` of them per row (the
features of positions length-1-W .. length-2), and a drafting round's first forward catches up on the pairs the
head has not cached (right-aligned, rows missing fewer have hidden holes on the left), ending with the pair of the
pending token, whose output gives the first draft. Pairs built from predicted features (the drafts') are hidden after
verification: their true features replace them in the next round's catch-up. Prefill runs nothing: the prompt's
features wait for the first round that runs the head.

Copies (greedy): text that repeats (a passage being summarised, code being edited) is better drafted by prompt
lookup than by any small head, and the two fail in different places. Each row's longest earlier match gives
candidate copies; a row drafts them first when copies of its match length have been accepted more often than the
head's first drafts, and the head drafts on after them, fed the copied tokens. Each round is sized like prompt
lookup's (expected tokens over measured cost, per width): a "head" round runs the head, a "copy" round verifies only
the copies and leaves the head alone (its features wait, and its next round catches up on them), and a round where
neither pays is a plain step. Where the target's runner packs verification (each row's real tokens only), a copy
round sizes each row on its own, as prompt lookup does (``per_token``): the batch's likeliest copies, the features of
the real tokens coming back all the same.

Depth (greedy, sized rounds): a head round drafts on while the head is sure. A row is *sure* of its drafts while the
product of the probabilities the head gave them (copies count 1) is at least ``DEPTH_CONFIDENCE``; the round stops
drafting once no row is sure, before the planned width if need be, and drafts past it, up to K, while one is, where
rows are verified one by one (one row, or ``per_token``); there each row verifies its drafts up to the first it is
not sure of. The head's probability of its first draft predicts its acceptance well (first drafts scored 0.0-0.1:
2% accepted, 0.3-0.4: 27%, 0.6-0.7: 64%, 0.8-1.0: 100%), where the plan prices every round from one running rate.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from transformers.models.llama import modeling_llama as hf

from ..batch import SlotState
from ..kv import move_rows, new_cache
from ..runner import Runner
from ..sampling import DRAFT, draw, greedy
from .base import Drafter, Proposal
from .lookup import PRIOR_WEIGHT, PromptLookup, likeliest

EXTRA = "eagle.safetensors"  # fc and token_map; the decoder layer, norm and head are a Llama checkpoint beside it


def is_checkpoint(path) -> bool:
    return Path(path, EXTRA).is_file()


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


class EagleState:
    """Per row: the head's slots, ``processed`` ``[B]`` (pairs cached) and ``feats`` ``[B, W, H]``, the target's
    features of the last ``W`` positions before the pending token, right-aligned (``W`` covers every pair a row has
    not cached; columns further left are holes)."""

    def __init__(self, slots: SlotState, processed: torch.Tensor, feats: torch.Tensor):
        self.slots, self.processed, self.feats = slots, processed, feats

    @property
    def feats(self) -> torch.Tensor:
        if self.aside:  # join the rounds that did not run the head once, not once per round
            self._feats, self.aside = _join(self._feats, self.aside), []
        return self._feats

    @feats.setter
    def feats(self, value: torch.Tensor) -> None:
        # aside: per round that did not run the head, its features ``[B, n, H]`` and how many of them are real per
        # row (None: all), not joined yet
        self._feats, self.aside = value, []

    @property
    def waiting(self) -> int:
        """A bound on the pairs a row waits to have cached (the feature columns kept, not joined yet)."""
        return self._feats.shape[1] + sum(h.shape[1] for h, _ in self.aside)

    def select_rows(self, rows):
        self.slots.select_rows(rows)
        self.processed = self.processed[rows]
        # the kept features move in place (a batch of long prompts keeps ~14 MB of them), the rounds aside stay aside
        self._feats = move_rows(self._feats, rows)
        self.aside = [(h[rows], None if n is None else n[rows]) for h, n in self.aside]

    def take(self, rows) -> "EagleState":
        return EagleState(self.slots.take(rows), self.processed[rows], self.feats[rows])

    def put(self, rows, part: "EagleState") -> None:
        self.slots.put(rows, part.slots)
        self.processed[rows] = part.processed
        mine, theirs = self.feats, part.feats
        t = max(mine.shape[1], theirs.shape[1])
        self.feats = _left_pad(mine, t)
        self.feats[rows] = _left_pad(theirs, t)

    def merge(self, other: "EagleState") -> "EagleState":
        mine, theirs = self.feats, other.feats
        t = max(mine.shape[1], theirs.shape[1])
        return EagleState(self.slots.merge(other.slots), torch.cat([self.processed, other.processed]),
                          torch.cat([_left_pad(mine, t), _left_pad(theirs, t)]))


def _left_pad(feats: torch.Tensor, t: int) -> torch.Tensor:
    return feats if feats.shape[1] == t else torch.nn.functional.pad(feats, (0, 0, t - feats.shape[1], 0))


def _join(feats: torch.Tensor, rounds: list) -> torch.Tensor:
    """``feats`` followed by each round's features, every row's real ones moved right (its holes to the left), as
    wide as the row with the most."""
    joined = torch.cat([feats, *(h for h, _ in rounds)], 1)
    if all(n is None for _, n in rounds):
        return joined
    real = torch.cat([torch.ones(feats.shape[:2], dtype=torch.bool, device=feats.device)] + [
        torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if n is None
        else torch.arange(h.shape[1], device=h.device)[None, :] < n[:, None] for h, n in rounds], 1)
    width = int(real.sum(1).max())  # one host read when the head next runs after rounds that copied
    order = real.to(torch.uint8).sort(dim=1, stable=True).indices[:, real.shape[1] - width:]
    return joined.gather(1, order[..., None].expand(-1, -1, joined.shape[-1]))


# rounds that draft copies only (the head does not run) / that run the head / that run it after a long wait
KINDS = ("copy", "head", "catch-up")
HEAD_STEP = 0.1  # a drafting step of the head, in plain steps, for widths not measured yet (measured: 0.08-0.11)
CATCH_UP = 32  # a head round catching up on more pairs than this per row is timed as a catch-up round
# what a catch-up round costs per waiting pair (all rows, holes included: the head's forward covers the rectangle)
# over a head round of its width, in plain steps, until the policy measured it: ~70 us a pair on a 2-core CPU for
# SmolLM2-135M's head, 0.0039 / 0.0028 / 0.0025 plain steps at 1 / 4 / 8 rows over Spec-Bench prompts of 660-770
# tokens (0.0005, the earlier prior, had the head catch up on 8 long prompts at batch 8 for 15 plain steps)
CATCH_UP_PAIR = 0.003
# a catch-up is paid once for the head rounds it makes possible (its cost is shared by this many rounds, and by no
# more than the rounds left: the most tokens a row may still generate): priced whole against one round, it loses to
# a plain or copy round, the wait grows by a pair a row every round the head does not run, and the head never runs
# again
CATCH_UP_SHARED = 8
# a head round drafts on while some row's drafts are at least this likely by the head's own probabilities (their
# product, copies counting 1). Against the planned width drafted whole, interleaved, batch 1, built-in prompts: 0.4
# read 1.24x plain where the width alone read 1.22x (accepted length 1.55 against 1.51, 5 pairs); 0.25 and 0.6 read
# 1.21x and 1.22x against 1.22x; Spec-Bench summarization + rag (mostly copy rounds) and batch 8 within +-1%.
# None: the planned width, drafted whole.
DEPTH_CONFIDENCE = 0.4


class EagleDrafter(Drafter):
    """``model``: a one-layer ``LlamaForCausalLM`` whose vocabulary is the ``N`` tokens of ``token_map`` (its
    embedding table is its head); ``fc``: ``Linear(2H, H)`` over [embedding of the next token, feature];
    ``embedding``: the target's input embedding (shared, not copied)."""

    name = "eagle"
    needs_hidden = True
    packs_rows = True  # copy rounds are sized row by row where the runner packs verification

    def __init__(self, model, fc: torch.nn.Linear, token_map: torch.Tensor, embedding: torch.nn.Embedding,
                 graphs: str = "auto", copy: bool = True):
        """``copy``: under greedy decoding, a row whose text repeats (prompt lookup finds a match) drafts the tokens
        that followed the match instead of the head's, while that match's first draft has been accepted more often
        than the head's; the head drafts on from where the copied tokens end."""
        self.model, self.fc, self.embedding = model, fc, embedding
        self.token_map = token_map.to(model.device)
        self.vocab = embedding.num_embeddings
        self.runner = Runner(model, graphs)
        self.copy = PromptLookup() if copy else None
        # with copies, greedy rounds are sized here: each width of each kind of round priced by the policy
        self.sizes_own_drafts, self.kinds, self.costs = copy, KINDS if copy else None, None
        self.table = None  # the head's first drafts accepted / scored

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path, target, dtype=None, graphs: str = "auto", copy: bool = True) -> "EagleDrafter":
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        dtype = dtype or target.dtype
        model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True).to(target.device).eval()
        extra = load_file(os.fspath(Path(path, EXTRA)))
        hidden = model.config.hidden_size
        fc = torch.nn.Linear(2 * hidden, hidden, bias="fc.bias" in extra, dtype=dtype, device=target.device)
        with torch.no_grad():
            fc.weight.copy_(extra["fc.weight"])
            if fc.bias is not None:
                fc.bias.copy_(extra["fc.bias"])
        fc.requires_grad_(False)
        emb = target.get_input_embeddings()
        if emb.embedding_dim != hidden:
            raise ValueError(f"draft head {os.fspath(path)!r} has hidden size {hidden}; the target has "
                             f"{emb.embedding_dim}")
        token_map = extra["token_map"].long()
        if int(token_map.max()) >= emb.num_embeddings:
            raise ValueError(f"draft head {os.fspath(path)!r} maps to token ids beyond the target's vocabulary")
        return cls(model, fc, token_map, emb, graphs, copy)

    @staticmethod
    def save(path, model, fc: torch.nn.Linear, token_map: torch.Tensor, card: dict | None = None) -> None:
        """Write a checkpoint ``load`` reads: the Llama part (``save_pretrained``), ``fc`` and ``token_map``."""
        from safetensors.torch import save_file

        path = Path(path)
        model.save_pretrained(path)
        tensors = {"fc.weight": fc.weight.detach().contiguous(), "token_map": token_map.to(torch.int64).contiguous()}
        if fc.bias is not None:
            tensors["fc.bias"] = fc.bias.detach().contiguous()
        save_file(tensors, os.fspath(path / EXTRA))
        if card is not None:
            (path / "eagle.json").write_text(json.dumps(card, indent=1))

    # ------------------------------------------------------------------------------------------------ rounds
    def _inputs(self, next_tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embedding(next_tokens), feats.to(self.fc.weight.dtype)], -1))

    def prefill(self, prompts, hidden=None):
        """Nothing runs yet: the prompt's features f_0 .. f_(n-2) wait (right-aligned), like those of rounds that did
        not run the head, and the first round that runs it catches up on them (rows that leave before the head pays
        never pay for their prompt)."""
        b, dev = hidden.shape[0], self.runner.device
        none = torch.zeros((b, 0), dtype=torch.long, device=dev)
        state = SlotState(self.runner, new_cache(self.model), none.bool(), none, none, "draft")
        feats = hidden if hidden.shape[1] else hidden.new_zeros((b, 1, hidden.shape[-1]))  # one-token prompts: a hole
        return EagleState(state, torch.zeros(b, dtype=torch.long, device=dev), feats)

    def propose(self, seqs, state: EagleState, k):
        length, k_max = seqs.length, k
        pairs = state.waiting * len(length) if state.waiting > CATCH_UP else 0  # a long wait to catch up on
        if self.copy is not None and not seqs.sampling:
            copies, n_copies, match = self.copy.candidates(seqs, k)
            left = (seqs.limit - seqs.generated()).max() if pairs else None  # rounds left, at most
            kind, k, use, n = self._plan(copies, n_copies, match, k, pairs, left)
            if not k:
                return Proposal.empty(len(length), length.device)
            if kind == "copy":  # the head does not run: its pairs wait for a round that runs it
                return Proposal(copies[:, :k], n, match=match, kind=kind)
        feats = state.feats
        m = feats.shape[1]
        at = (length - 1)[:, None] - m + torch.arange(m, device=length.device)[None, :]  # ends at length-2
        tok = seqs.history.gather(1, at.clamp(min=0))
        nxt = seqs.history.gather(1, (at + 1).clamp(min=0))
        out = state.slots.append(tok, at >= state.processed[:, None], logits_to_keep=1, hidden=True,
                                 embeds=self._inputs(nxt, feats))
        state.processed = torch.maximum(state.processed, length - 1)
        u = seqs.uniforms(k, DRAFT) if seqs.sampling else None
        drafts, qs, first = [], [], None
        # greedy rounds sized here: the head drafts on while a row is sure (past the plan where rows are verified one
        # by one), and stops when none is; sures[i] [B]: P(a row's drafts 1..i+1 are right) by the head's probabilities
        deep = u is None and self.costs is not None and DEPTH_CONFIDENCE is not None
        sures = []
        for i in range(k_max if deep and (len(length) == 1 or self.per_token) else k):
            if deep and i and not bool((sures[-1] >= DEPTH_CONFIDENCE).any()):  # one host read a step
                break
            if i:
                slot = seqs.pending() if i == 1 else drafts[-2]  # the token at this pair's position
                out = state.slots.append(slot[:, None], logits_to_keep=1, hidden=True,
                                         embeds=self._inputs(drafts[-1][:, None], out.hidden[:, -1:]))
            logits = out.logits[:, -1]
            if u is None:
                drafts.append(self.token_map[greedy(logits)])
                if self.copy is not None:  # rows whose copies earned it draft them; the head drafts on after them
                    if not i:
                        first = torch.stack([match, n_copies, copies[:, 0], drafts[0], use.long()], 1)
                    drafts[-1] = torch.where(use & (i < n_copies), copies[:, i], drafts[-1])
                if deep:  # (rounds are sized here only with copies)
                    p = torch.where(use & (i < n_copies), 1.0, logits.float().softmax(-1).amax(-1))
                    sures.append(sures[-1] * p if sures else p)
            else:  # the head's distribution spread over the whole vocabulary (zero outside the map)
                full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
                full[:, self.token_map] = logits
                qs.append(seqs.warp(full[:, None])[:, 0])
                drafts.append(draw(qs[-1], u[:, i]))
        # a round that caught up on a long wait (a prompt, many rounds without the head) is timed apart: its cost is
        # once per wait, not what a head round of its width costs: a head round plus the pairs it caches
        catch_up = first is not None and pairs > 0
        kind = None if first is None else "catch-up" if catch_up else "head"
        k = len(drafts)
        n = torch.full_like(length, k)
        if deep and self.per_token:  # each row: its drafts up to the first it is not sure of
            n = ((torch.stack(sures, 1) >= DEPTH_CONFIDENCE).sum(1) + 1).clamp(max=k)
        return Proposal(torch.stack(drafts, 1), n, torch.stack(qs, 1) if qs else None,
                        match=first, kind=kind, work=pairs if catch_up else 0, base="head" if catch_up else None)

    def _plan(self, copies, n_copies, match, k: int, catch_up: int = 0, left=None):
        """``(kind, width, rows that copy, drafts per row of a copy round)`` for a greedy round of at most k drafts.
        A row copies first when its match length's first copied draft is accepted more often than the head's first
        draft. Each kind of round and size is worth its expected tokens over its cost (``costs``, in plain steps):
        "copy" rounds verify only the copies (rows without a match draft nothing; the head does not run), "head"
        rounds run the head for j steps (it drafts on after the copies), priced as a "catch-up" round when the head
        has a long wait to catch up on (``catch_up``: the waiting pairs of all rows; ``left``: the most tokens a row
        may still generate, a device scalar, or None for many). Where rows are sized one by one (``per_token``: the
        runner packs verification), a copy round verifies the m likeliest copies of the batch (each row's first
        ones), m = 0..rows x k, priced by the drafts it verifies in all, and a head round of width j is priced as
        rows x j drafts. Without costs (fixed length): a "head" round of k."""
        dev, b = match.device, len(match)
        col = torch.arange(k, device=dev)[None, :]
        copied = self.copy.survival(k, dev)[match] * (col < n_copies[:, None])  # [B, k] P(copies 1..j accepted)
        head = self._head_survival(k, dev)  # [k]
        use = (n_copies > 0) & (copied[:, 0] > head[0])
        if self.costs is None:
            return "head", k, use, None
        last = copied.gather(1, (n_copies - 1).clamp(min=0)[:, None])
        mixed = torch.where(col < n_copies[:, None], copied, last * head[(col - n_copies[:, None]).clamp(min=0)])
        mixed = torch.where(use[:, None], mixed, head[None, :])
        per = b if self.per_token else 1  # drafts verified per unit of a head round's width
        if per > 1:  # a copy round's m copies of the batch worth most: E(m), m = 0..b*k
            copied, mixed = self.worth(copied), self.worth(mixed)  # each row's expected tokens at its worth
            gain, rank = likeliest(copied)
        else:  # one width for the batch: E(j), j = 0..k, from each column's expected accepted drafts
            gain = copied.sum(0).cumsum(0)
        pad = torch.nn.functional.pad
        tokens = b + torch.cat([pad(gain, (1, 0)), pad(mixed.sum(0).cumsum(0), (1, 0))])  # copy m, then head j
        costs = self._round_costs(k, dev, catch_up, per, left)  # [copy / head, m = 0..k*per]
        best = (tokens / torch.cat([costs[0], costs[1, ::per]])).argmax()  # the first of equals: a plain step
        copy_round = best <= k * per
        if per > 1:  # a copy round of m drafts: each row's first ones among the m likeliest
            n = torch.where(copy_round, (rank < best).sum(1), 0)
        else:
            n = torch.where(copy_round, n_copies.clamp(max=best), 0)
        best, width = torch.stack([best, n.max()]).tolist()  # the round's host read
        if best <= k * per:
            return "copy", width, use, n
        return "head", best - k * per - 1, use, None

    def _round_costs(self, k: int, device, catch_up: int = 0, per: int = 1, left=None) -> torch.Tensor:
        """``[copy / head, m]``: a round verifying m = 0..k x ``per`` drafts in all, in plain steps (``per``: the rows
        of a round sized row by row, where a head round of width j verifies j x rows; else 1, and m is the width):
        what the policy gives per kind (measured, or its line through that kind's rounds); else, for a copy round
        ``1 + 0.2 m / per``, for a head round the copy round of its size plus ``HEAD_STEP`` per step the head runs;
        never falling with m; sizes past what the policy prices (what the runner packs) ``inf``. After a long wait
        (``catch_up`` pairs waiting, all rows) a head round costs a head round of its size plus each waiting pair's
        cost, as the policy measured it from catch-up rounds (``costs["work"]["catch-up"]``), else
        ``CATCH_UP_PAIR``, shared by ``CATCH_UP_SHARED`` rounds or by the rounds ``left`` if fewer. Priced by pairs,
        not by what a catch-up round of that width cost once (its wait's cost), and shared, not charged to one round:
        priced whole, a catch-up lost to a plain round, the wait grew every round, and the head stayed out for
        hundreds of rounds (on the main job's prompts at batch 1 the head's mean accepted length fell from ~1.55 to
        1.05–1.3 for one to five runs in a row, in three of four engines; shared, 1.46–1.65 in every run). A size the
        policy has not let a kind explore yet (``inf``) stays out of reach."""
        n = k * per
        given = {kind: list(self.costs.get(kind) or [])[: n + 1] for kind in ("copy", "head")}
        priced = [len(v) - 1 for v in given.values() if v]
        most = min(n, *priced) if per > 1 and priced else n  # what the runner packs
        given = {kind: values + [None] * (n + 1 - len(values)) for kind, values in given.items()}
        prior = [1.0 + self.copy.default_cost * m / per if m <= most else math.inf for m in range(n + 1)]
        copy = [c if c is not None else p for c, p in zip(given["copy"], prior)]  # inf: not explored yet
        known = [c if math.isfinite(c) else p for c, p in zip(copy, prior)]
        head = [g if g is not None else c + HEAD_STEP * m / per for m, (g, c) in enumerate(zip(given["head"], known))]
        costs = torch.tensor([copy, head], dtype=torch.float64, device=device)
        if catch_up:
            pair = (self.costs.get("work") or {}).get("catch-up")
            shared = CATCH_UP_SHARED if left is None else left.clamp(1, CATCH_UP_SHARED)  # on the device: no read
            costs[1] += (CATCH_UP_PAIR if pair is None else pair) * catch_up / shared
        return costs.cummax(1).values

    def _head_survival(self, k: int, device) -> torch.Tensor:
        """``[k]`` P(the head's drafts 1..j all accepted): its first-draft rate (``PRIOR_WEIGHT`` pseudo-rounds at
        0.5) to the power j. Measured per index under training-time test, the later drafts' rates given the earlier
        accepted are about the first's (0.41 / 0.40 / 0.44 / 0.46 on the built-in prompts), and unlike them the
        first is scored in every round that runs the head, so a width seldom drafted is not priced from stale
        evidence."""
        hits, scored = self._table(device)
        rate = (hits + PRIOR_WEIGHT * 0.5) / (scored + PRIOR_WEIGHT)
        return rate ** torch.arange(1, k + 1, device=device, dtype=torch.float64)

    def _table(self, device) -> torch.Tensor:
        """``[2]``: the head's first drafts accepted / scored."""
        if self.table is None or self.table.device != device:
            self.table = torch.zeros(2, dtype=torch.float64, device=device)
        return self.table

    def _learn(self, proposal: Proposal, accepted: torch.Tensor, target) -> None:
        """Acceptance of copies (per match length and index) and of the head's first drafts. Both first drafts are
        scored in every round that runs the head, whichever was drafted (the target's first token is known); the
        copies' later indices where drafted."""
        if proposal.kind == "copy":
            self.copy.commit(None, proposal, accepted, target)
            return
        match, n_copies, copied, head, use = proposal.match.unbind(1)
        token = target.tokens()[:, 0]
        use = use.bool()
        weak = (n_copies > 0) & ~use  # copies not drafted: their first one scored all the same
        offered = torch.where(use, n_copies.clamp(max=proposal.drafts.shape[1]), weak.long())
        right = torch.where(use, torch.minimum(accepted, offered), (weak & (copied == token)).long())
        self.copy.commit(None, Proposal(proposal.drafts, offered, match=match), right, target)
        table = self._table(token.device)
        table[0] += (head == token).sum()
        table[1] += len(token)

    def commit(self, state: EagleState, proposal: Proposal, accepted, target) -> None:
        k = proposal.drafts.shape[1]
        if proposal.match is not None:
            self._learn(proposal, accepted, target)
        if not k or proposal.kind == "copy":  # the head did not run: the new features wait for a round that runs it
            state.aside.append((target.hidden.to(state._feats.dtype), accepted + 1 if k else None))
            return
        if k > 1:  # the drafts' pairs were built from predicted features
            state.slots.hide_tail(k - 1, torch.zeros_like(accepted))
        # features of positions length-1-k .. length'-2, where length' = length + accepted + 1 (the head cached
        # every pair before the pending token's)
        feats = target.hidden.to(state._feats.dtype)
        index = (accepted[:, None] + torch.arange(-k, 1, device=accepted.device)[None, :]).clamp(min=0)
        state.feats = feats.gather(1, index[..., None].expand(-1, -1, feats.shape[-1]))

    def states(self, state):
        return (state.slots,)

    def processed(self, seqs, state):
        return state.processed
