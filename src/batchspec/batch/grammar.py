"""Structured output under speculation: each constrained row keeps a grammar matcher (llguidance's ``LLMatcher``)
in the state of its emitted tokens. Before verification a copy of it walks the row's drafts, giving the mask of
legal tokens at every position (position j after drafts 1..j) and cutting the drafts at the first one it forbids;
after the round's host read the matcher consumes the tokens the row emitted (accepted drafts and the bonus), which
is where rejection leaves it. Masks are the ones batch-1 decoding would apply, so greedy output stays the same.
Tokens a row's grammar forces (``forced``: the only token its mask allows, a schema's keys and punctuation, say) are
drafted first at no drafter cost ("jump-forward" as speculation). Rows without a grammar cost nothing: with none in
the batch no code here runs."""

from __future__ import annotations

import torch

from ..params import ParamError
from ..sampling import greedy

GRAMMAR = "grammar"  # the finish reason of a row whose grammar reached a dead end
# the most forced tokens a row drafts in a round of an engine without a drafter (its K is 0): a schema's keys and
# punctuation run a few tokens, a longer run goes on in the next rounds
FORCED_MOST = 8


class Grammars:
    """Builds matchers for requests' grammars (``SamplingParams.structured``) over one tokenizer, made into
    llguidance's form on first use (about a second for a large vocabulary)."""

    def __init__(self, tokenizer, vocab: int, eos: set[int]):
        self.tokenizer, self.vocab, self.eos, self._ll = tokenizer, vocab, eos, None

    def matcher(self, grammar: str, param: str = "grammar"):
        """A matcher at the start of ``grammar``; ``ParamError`` when no token the vocabulary holds can begin it."""
        import llguidance
        import llguidance.hf

        if self._ll is None:
            eos = sorted(self.eos) or self.tokenizer.eos_token_id
            if eos is None:
                raise ParamError(param, "structured output needs a tokenizer or model with an end-of-sequence token")
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab, eos_token=eos)
        m = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        m.compute_bitmask()
        if m.is_error():
            reason = m.get_error().splitlines()[0][:100]
            raise ParamError(param, f"the grammar cannot be followed with this vocabulary ({reason})")
        return m


def forced(seqs, room: int, vocab: int) -> tuple[torch.Tensor, list[int]] | None:
    """The tokens each row's grammar forces from its state, at most ``room`` a row: ``(tokens [B, F] on the
    device (0 past a row's count), counts [B] on the host)``, None when no row has one. llguidance's fast-forward
    tokens are one tokenization of the bytes the grammar forces, which other tokens may spell too: a token is kept only
    while it is the one token the row's mask allows, so batch-1 decoding with the mask emits it whatever the logits
    (greedy or sampled: its probability is 1, and drafted one-hot it is always accepted). The end-of-sequence token is
    never among them. Each walk runs on a copy of the row's matcher."""
    from llguidance.torch import fill_next_token_bitmask

    rows = {}
    bits = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    for i in seqs.grammar_rows:
        m = seqs.matchers[i]
        tokens = m.compute_ff_tokens()[:room] if not m.is_stopped() else []
        if tokens:
            m, kept = m.deep_copy(), []
            for t in tokens:
                fill_next_token_bitmask(m, bits)
                if bits.count_nonzero() != 1 or int(bits[0, t // 32]) & 0xFFFFFFFF != 1 << (t % 32):
                    break  # another token is legal here too (or none is)
                kept.append(t)
                m.consume_token(t)
            if kept:
                rows[i] = kept
    if not rows:
        return None
    counts = [len(rows.get(i, ())) for i in range(len(seqs.matchers))]
    tokens = torch.zeros((len(counts), max(counts)), dtype=torch.long)
    for i, kept in rows.items():
        tokens[i, : len(kept)] = torch.tensor(kept)
    return tokens.to(seqs.length.device), counts


class Legal:
    """The legal tokens of a round's constrained positions: flat position ``positions[p]`` of the ``[B, W]`` block
    allows the tokens set in ``bits[p]`` (llguidance's packed mask: bit t % 32 of word t // 32); every position not
    listed allows every token. Only listed positions are masked, and under greedy decoding only those whose argmax
    the mask forbids, so rows without a grammar cost nothing and a greedy round rarely masks at all."""

    def __init__(self, positions: torch.Tensor, bits: torch.Tensor, vocab: int):
        self.positions, self.bits, self.vocab = positions, bits, vocab

    def _masked_rows(self, logits: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """``[len(which), vocab]``: a copy of the logits of listed positions ``which``, illegal tokens at -inf. The
        packed words expand a byte at a time from a table (their bytes in memory order, lowest first: little-endian,
        as on every device torch runs on here): a bool a token, no wider temporary."""
        table = _BLOCKED.get(self.bits.device)
        if table is None:
            bit = torch.arange(8, device=self.bits.device)
            table = _BLOCKED[self.bits.device] = ((torch.arange(256, device=self.bits.device)[:, None] >> bit) & 1) == 0
        blocked = table.index_select(0, self.bits.index_select(0, which).view(torch.uint8).view(-1).int())
        x = logits.reshape(-1, self.vocab).index_select(0, self.positions.index_select(0, which))
        return x.masked_fill_(blocked.view(x.shape[0], -1)[:, : self.vocab], float("-inf"))

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` ``[B, W, vocab]`` with each listed position's illegal tokens at -inf."""
        out = logits.clone()
        every = torch.arange(len(self.positions), device=self.positions.device)
        out.view(-1, self.vocab).index_copy_(0, self.positions, self._masked_rows(logits, every))
        return out

    def greedy(self, tokens: torch.Tensor, logits) -> torch.Tensor:
        """``greedy(self.masked(logits()))`` ``[B, W]`` from ``tokens``, each position's argmax without the masks
        (``logits()``: the block's logits, computed only when needed). Where the mask allows that token it stays, as
        the first largest logit of all, being legal, is the first of the legal ones; elsewhere the argmax is taken
        again over the legal tokens. One host read (which positions need it)."""
        best = tokens.view(-1).index_select(0, self.positions)
        word = self.bits.gather(1, (best // 32)[:, None])[:, 0].long()
        redo = (((word >> best % 32) & 1) == 0).nonzero()[:, 0]
        if not len(redo):
            return tokens
        tokens = tokens.clone()
        tokens.view(-1).index_copy_(0, self.positions[redo], greedy(self._masked_rows(logits(), redo)))
        return tokens


_BLOCKED: dict = {}  # device -> [256, 8] bool: per byte value, which of its bits (lowest first) are not set


def masks(seqs, drafts: torch.Tensor, n_drafts: torch.Tensor, vocab: int) -> tuple[Legal, torch.Tensor, dict]:
    """The round's legal tokens (``Legal``: the constrained rows' positions up to their last verified draft;
    unconstrained rows allow all), the drafts each row verifies (cut before the first one its grammar forbids) and
    the dead ends: row -> the first position where its grammar allows nothing (left unmasked there; the row ends if
    it emits a token at it). One host read of the drafts; each constrained row's walk runs on a copy of its matcher,
    which stays as it was."""
    from llguidance.torch import fill_next_token_bitmask

    w = drafts.shape[1] + 1
    bits = torch.empty((len(seqs.grammar_rows) * w, (vocab + 31) // 32), dtype=torch.int32)
    d, n = drafts.tolist(), n_drafts.tolist()
    at, dead = [], {}  # the flat positions masked, in the order of their masks
    for i in seqs.grammar_rows:
        m, j = seqs.matchers[i].deep_copy(), 0
        while True:  # a complete grammar's mask allows only the end-of-sequence token: the walk stops there
            fill_next_token_bitmask(m, bits, len(at))
            if m.is_error():  # nothing continues the grammar here
                dead[i] = j
                break
            at.append(i * w + j)
            if m.is_stopped() or j == n[i] or not m.try_consume_tokens([d[i][j]]):
                break
            j += 1
        n[i] = j
    device = drafts.device
    legal = Legal(torch.tensor(at, dtype=torch.long).to(device), bits[: len(at)].to(device), vocab)
    return legal, torch.tensor(n, dtype=n_drafts.dtype, device=device), dead


def advance(seqs, rows: list[int], emitted: list[int], block: list[list[int]], dead: dict) -> dict[int, tuple]:
    """The matchers of the round's rows (``rows[i]``: row i's place in ``seqs``) consume the tokens they emitted.
    Returns the rows that end here: round row -> (tokens kept, reason): "stop" for a grammar now complete (a token
    after its end, the end-of-sequence token its mask forced, is dropped, so the output is the same whether or not
    that token was verified in the same round), "grammar" for a token emitted at a dead end (dropped)."""
    ends = {}
    for i, r in enumerate(rows):
        m = seqs.matchers[r]
        if m is None:
            continue
        tokens, kept = block[i][: emitted[i]], 0
        for t in tokens[: dead.get(i, len(tokens))]:
            if m.is_stopped() or not m.try_consume_tokens([t]):
                break
            kept += 1
        if m.is_stopped():
            ends[i] = (kept, "stop")
        elif kept < len(tokens):  # a dead end (a token the masks cannot have let through ends the row the same way)
            ends[i] = (kept, GRAMMAR)
    return ends
