"""A draft head that reads the target's features (EAGLE, Li et al. 2024, arXiv 2401.15077), with a vocabulary-
restricted output head (FR-Spec, arXiv 2502.14856).

The target's final hidden state at position i (its *feature* f_i, what its head reads to predict token i+1) and the
embedding of token i+1 go through ``fc`` into one Llama decoder layer, whose normalised output predicts f_(i+1); the
head scores only the ``N`` most frequent tokens (``token_map``: head row -> token id). Drafting feeds the predicted
feature back in with the drafted token.

Its cache holds one slot per *pair* (f_i, x_(i+1)), filed under position i and token x_i, so it obeys the same
invariants as the target's: at rest it holds positions 0..processed-1 of the row's history. The verification forward
returns the target's features (``TargetOutput.hidden``); a prompt's come from its prefill (``batch.FEATURES``: where
the whole prefill runs, the last layer's input, which spares the prefill that layer but its keys and values); the
state keeps the last ``W`` of them per row (the
features of positions length-1-W .. length-2), and a drafting round's first forward catches up on the pairs the
head has not cached (right-aligned, rows missing fewer have hidden holes on the left), ending with the pair of the
pending token, whose output gives the first draft. Pairs built from predicted features (the drafts') are hidden after
verification: their true features replace them in the next round's catch-up. A batch's first rows leave their
prompt's pairs waiting for the first round that runs the head; rows joining a running batch cache theirs at admission,
so that a long prompt never widens the running rows' catch-up (unless the policy says the drafter is dry: then theirs
wait too, rather than be cached for a head that may not run).

Copies (greedy): text that repeats (a passage being summarised, code being edited) is better drafted by prompt
lookup than by any small head, and the two fail in different places. Each row's longest earlier match gives
candidate copies; a row drafts them first when copies of its match length have been accepted more often than the
head's first drafts, and the head drafts on after them, fed the copied tokens. The drafter offers the copies
(with their match lengths) and its cost terms, and speculation plans each round from them like prompt lookup's
(``speculation.plan``): a "head" round runs the head, a "copy" round verifies only the copies and leaves the head alone
(its features wait, and its next round catches up on them), and a round where neither pays is a plain step. Where the
target's runner packs verification (each row's real tokens only), a copy round sizes each row on its own, as prompt
lookup does (``budget.per_row``): the batch's likeliest copies, the features of the real tokens coming back all the
same.

Depth (greedy, sized rounds): a head round drafts on while the head is sure. A row is *sure* of its drafts while the
product of the probabilities the head gave them (copies count 1) is at least the plan's ``sure``; the round stops
drafting once no row is sure, before the planned width if need be, and drafts past it, up to the plan's ``most``,
while one is; with ``rowwise`` each row verifies its drafts up to the first it is not sure of. The plan prices every
round from one running rate; the head's own probability of a draft tells its rounds apart (it predicts acceptance
well: docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ...batch import SlotState, prefill
from ...sampling import Stream, draw, greedy
from ...model.kv import new_cache
from ...model.runner import Runner
from ...speculation.plan import KINDS, DraftPlan, Offer
from ..base import Drafter, Proposal, widened
from ..lookup import PromptLookup
from .state import EagleState

ASIDE = ("copy", "forced")  # the kinds of round the head does not run in (``speculation.plan``)
EXTRA = "eagle.safetensors"  # fc and token_map; the decoder layer, norm and head are a Llama checkpoint beside it


def is_checkpoint(path) -> bool:
    return Path(path, EXTRA).is_file()


class EagleDrafter(Drafter):
    """``model``: a one-layer ``LlamaForCausalLM`` whose vocabulary is the ``N`` tokens of ``token_map`` (its
    embedding table is its head); ``fc``: ``Linear(2H, H)`` over [embedding of the next token, feature];
    ``embedding``: the target's input embedding (shared, not copied)."""

    name = "eagle"
    needs_hidden = True
    packs_rows = True  # copy rounds are sized row by row where the runner packs verification
    takes_forced = True  # a grammar's forced tokens first, the head fed them like copies

    def __init__(self, model, fc: torch.nn.Linear, token_map: torch.Tensor, embedding: torch.nn.Embedding,
                 graphs: str = "auto", copy: bool = True):
        """``copy``: under greedy decoding, a row whose text repeats (prompt lookup finds a match) drafts the tokens
        that followed the match instead of the head's, while that match's first draft has been accepted more often
        than the head's; the head drafts on from where the copied tokens end."""
        self.model, self.fc, self.embedding = model, fc, embedding
        self.dtype = model.dtype  # fc's too (a packed fc expands to it)
        self.token_map = token_map.to(model.device)
        self.vocab = embedding.num_embeddings
        self.runner = Runner(model, graphs)
        # with copies, greedy rounds offer prompt lookup's candidates too, and speculation plans each kind and width
        self.copy = PromptLookup() if copy else None
        self.sizes_own_drafts = copy

    # ------------------------------------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path, target, dtype=None, graphs: str = "auto", copy: bool = True,
             weights: str = "fp32") -> "EagleDrafter":
        """The head saved at ``path`` for ``target``; ``weights="auto"``: its weights kept in the narrowest format
        that holds them exactly (a head saved in fp16 and run in fp32 reads half the bytes), see
        ``batchspec.model.weights``."""
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
        if weights == "auto":
            from ...model.weights import PackedLinear, pack, pack_model

            holder = torch.nn.ModuleDict({"model": model, "fc": fc})  # packs fc and the model's linears in place
            pack_model(holder)
            fc = holder["fc"]
            packed = pack(fc.weight.detach()) if fc.bias is not None and fc.weight.device.type == "cpu" else None
            if packed is not None:  # a biased fc (pack_model keeps torch's bits there; a draft's need not be)
                fc = PackedLinear(packed, fc.bias)
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
        return self.fc(torch.cat([self.embedding(next_tokens), feats.to(self.dtype)], -1))

    def timing(self):
        """What the cost profile times as one drafting forward: the head's runner, its input layer, its features."""
        feats = torch.zeros((1, self.fc.in_features // 2), dtype=self.dtype, device=self.runner.device)
        return self.runner, lambda ids: self._inputs(ids, feats.expand(*ids.shape, -1)), True

    def prefill(self, prompts, hidden=None, joining: bool = False):
        """The prompt's features f_0 .. f_(n-2) (``hidden``, right-aligned), their pairs (f_i, x_(i+1)) not cached
        yet. Rows that start a batch leave them waiting, and the first round that runs the head catches up on them
        (priced per pair by the plan), so a batch the head never pays for never pays for its prompts. Rows
        ``joining`` a running batch have their pairs of positions 0 .. n-3 cached here, like the target's prefill (end
        to end where it can, computing only the keys and values the cache holds: 1-2.5% of the target's prefill,
        8% as whole forwards), so that a long prompt never widens the running rows' catch-up; the feature of position
        n-2 waits: its pair with the pending token gives the first draft."""
        b, dev = hidden.shape[0], self.runner.device
        w = hidden.shape[1]  # features of positions up to n-2, right-aligned ([B, W, H], zeros on the left)
        if not joining or w < 2:
            none = torch.zeros((b, 0), dtype=torch.long, device=dev)
            state = SlotState(self.runner, new_cache(self.model), none.bool(), none, none, "draft")
            feats = hidden if w else hidden.new_zeros((b, 1, hidden.shape[-1]))  # one-token prompts: a hole
            return EagleState(state, torch.zeros(b, dtype=torch.long, device=dev), feats)
        nxt = torch.tensor([[0] * (w - len(p[1:])) + p[1:] for p in prompts], device=dev)  # x_1 .. x_(n-1)
        index = torch.arange(b, device=dev)

        def inputs(rows, n):  # a group's pairs of positions up to n-3: next tokens x_1.., features f_0..
            r = index[rows]
            return self._inputs(nxt[r, w - 1 - n : w - 1], hidden[r, w - 1 - n : w - 1])

        state = prefill(self.runner, [p[:-1] if len(p) > 1 else p for p in prompts], "draft", embeds=inputs)
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        return EagleState(state, (lengths - 2).clamp(min=0), hidden[:, -1:])

    def offer(self, seqs, state: EagleState, k: int) -> Offer:
        """Greedy, with copies: each row's copies up to k and match length, and a head round's cost terms (the pairs
        a row waits to have cached, and the most tokens a row may still generate while many wait); else nothing to
        weigh per row (a head round of the plan's k)."""
        length = seqs.length
        if self.copy is None or seqs.sampling:
            return Offer(len(length), length.device, sampling=seqs.sampling)
        copies, n_copies, match = self.copy.candidates(seqs, k)
        waiting = state.waiting
        left = (seqs.limit - seqs.generated()).max() if waiting > k + 1 else None  # rounds left, at most
        return Offer(len(length), length.device, copies, n_copies, match, self.copy.max_ngram + 1, KINDS,
                     waiting=waiting, left=left)

    def propose(self, seqs, state: EagleState, plan: DraftPlan):
        """The plan's drafts: a copy round's copies, a forced round's forced tokens (the head does not run: its pairs
        wait for a round that runs it), or a head round's drafts, a row's forced tokens first (``plan.forced``: they
        take the place of its copies, and the head drafts on from them, their q one-hot when sampled)."""
        length, k, offer = seqs.length, plan.width, plan.offer
        if plan.kind in ASIDE:
            proposal = self.forced_first(plan, widened(offer.candidates, len(length), k, length.device), plan.drafts)
            return Proposal(proposal.drafts, proposal.n_drafts, kind=plan.kind)
        copies, n_copies, use = offer.candidates, offer.count, plan.use
        forced, n_forced = plan.forced, plan.n_forced
        if forced is not None and use is not None:  # a row's copies start where its forced tokens do: not both
            use = use & (n_forced == 0)
            copies = widened(copies, len(length), max(plan.most, k), length.device)
        feats = state.feats
        m = feats.shape[1]
        at = (length - 1)[:, None] - m + torch.arange(m, device=length.device)[None, :]  # ends at length-2
        tok = seqs.history.gather(1, at.clamp(min=0))
        nxt = seqs.history.gather(1, (at + 1).clamp(min=0))
        out = state.slots.append(tok, at >= state.processed[:, None], logits_to_keep=1, hidden=True,
                                 embeds=self._inputs(nxt, feats))
        state.processed = torch.maximum(state.processed, length - 1)
        u = seqs.uniforms(k, Stream.DRAFT) if seqs.sampling else None
        drafts, qs, first = [], [], None
        # as the plan says: the head drafts on while a row is sure (up to ``plan.most``), and stops when none is;
        # sures[i] [B]: P(a row's drafts 1..i+1 are right) by the head's probabilities
        deep = u is None and plan.sure is not None
        sures = []
        for i in range(max(plan.most, k) if deep else k):
            if deep and i and not bool((sures[-1] >= plan.sure).any()):  # one host read a step
                break
            if i:
                slot = seqs.pending() if i == 1 else drafts[-2]  # the token at this pair's position
                out = state.slots.append(slot[:, None], logits_to_keep=1, hidden=True,
                                         embeds=self._inputs(drafts[-1][:, None], out.hidden[:, -1:]))
            logits = out.logits[:, -1]
            if u is None:
                drafts.append(self.token_map[greedy(logits)])
                if copies is not None:  # rows whose copies earned it draft them; the head drafts on after them
                    if not i:
                        first = drafts[0]
                    drafts[-1] = torch.where(use & (i < n_copies), copies[:, i], drafts[-1])
            else:  # the head's distribution spread over the whole vocabulary (zero outside the map)
                full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
                full[:, self.token_map] = logits
                qs.append(seqs.warp(full[:, None])[:, 0])
                drafts.append(draw(qs[-1], u[:, i]))
            here = None
            if forced is not None and i < forced.shape[1]:
                here = i < n_forced
                drafts[-1] = torch.where(here, forced[:, i], drafts[-1])
                if qs:
                    one_hot = torch.nn.functional.one_hot(drafts[-1], self.vocab).to(qs[-1].dtype)
                    qs[-1] = torch.where(here[:, None], one_hot, qs[-1])
            if deep:  # (rounds are sized here only with copies); copies and forced tokens count 1
                given = use & (i < n_copies)
                p = torch.where(given if here is None else given | here, 1.0, logits.float().softmax(-1).amax(-1))
                sures.append(sures[-1] * p if sures else p)
        kind = None if first is None else "head"
        n = plan.drafts
        if deep:  # as far as some row was sure
            k = len(drafts)
            n = n.new_full(n.shape, k)
            if plan.rowwise:  # each row: its drafts up to the first it is not sure of
                n = ((torch.stack(sures, 1) >= plan.sure).sum(1) + 1).clamp(max=k)
        if forced is not None:
            n = torch.maximum(n, n_forced)
        return Proposal(torch.stack(drafts, 1), n, torch.stack(qs, 1) if qs else None, kind, first)

    def commit(self, state: EagleState, proposal: Proposal, accepted, target) -> None:
        k = proposal.drafts.shape[1]
        if not k or proposal.kind in ASIDE:  # the head did not run: the new features wait for a round that runs it
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
