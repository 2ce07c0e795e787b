"""Logits processors at every verified position: ``process`` turns a round's target logits ``[B, W, V]`` (position j
verifies draft j, position 0 follows the pending token) into the logits batch-1 decoding would process there. At
position j a row's history is its prompt, its output and drafts 1..j (the drafts emitted before that position, if
it is reached), so penalties, bad words and ``min_tokens`` see exactly what they would see one token at a time.

Order (vLLM's): ``logit_bias`` added; bad words' last tokens and, before ``min_tokens`` were generated, the row's stop
ids masked; ``repetition_penalty`` (Hugging Face's, over prompt + output); ``frequency_penalty`` and
``presence_penalty`` (OpenAI's, over the output). ``min_p`` comes after temperature, top-k and top-p
(``sampling.warp``). Everything is vectorised over rows and positions; a kind no row of the batch uses costs nothing."""

from __future__ import annotations

import torch

# the kinds of processor a row may use (``Sequences.processors``: those some row of the batch uses)
BIAS, BAD_WORDS, MIN_TOKENS, REPETITION, PENALTIES = "bias", "bad_words", "min_tokens", "repetition", "penalties"


def kinds(r) -> set[str]:
    """The processors request ``r`` uses (its fields as ``SamplingParams`` names them; absent ones are off)."""
    used = {BIAS: getattr(r, "logit_bias", None), BAD_WORDS: getattr(r, "bad_words", None),
            MIN_TOKENS: getattr(r, "min_tokens", 0) > 0, REPETITION: getattr(r, "repetition_penalty", 1.0) != 1.0,
            PENALTIES: getattr(r, "presence_penalty", 0.0) != 0.0 or getattr(r, "frequency_penalty", 0.0) != 0.0}
    return {kind for kind, on in used.items() if on}


def tables(requests, device) -> dict[str, torch.Tensor]:
    """Each row's processor settings as device tensors (once per request, when rows join): ``repetition``,
    ``presence``, ``frequency`` ``[B]`` float64; ``min_tokens`` ``[B]``; ``bias_ids`` / ``bias_values`` ``[B, M]``
    (id -2: no entry); ``bad_words`` ``[B, N, L]``, each word from its first column on (id -2 after its end)."""
    b = len(requests)
    biases = [dict(getattr(r, "logit_bias", None) or {}) for r in requests]
    words = [list(getattr(r, "bad_words", None) or []) for r in requests]
    m = max(max((len(x) for x in biases), default=0), 1)
    n = max(max((len(w) for w in words), default=0), 1)
    length = max(max((len(x) for w in words for x in w), default=0), 1)
    bias_ids = torch.full((b, m), -2, dtype=torch.long)
    bias_values = torch.zeros(b, m, dtype=torch.float64)
    bad = torch.full((b, n, length), -2, dtype=torch.long)
    for i, (bias, ws) in enumerate(zip(biases, words)):  # once per request
        if bias:
            bias_ids[i, : len(bias)] = torch.tensor(list(bias))
            bias_values[i, : len(bias)] = torch.tensor(list(bias.values()), dtype=torch.float64)
        for j, w in enumerate(ws):
            bad[i, j, : len(w)] = torch.tensor(w)

    def per_row(name, off):
        return torch.tensor([float(getattr(r, name, off)) for r in requests], dtype=torch.float64)

    out = dict(repetition=per_row("repetition_penalty", 1.0), presence=per_row("presence_penalty", 0.0),
               frequency=per_row("frequency_penalty", 0.0), min_p=per_row("min_p", 0.0),
               min_tokens=torch.tensor([getattr(r, "min_tokens", 0) for r in requests]), bias_ids=bias_ids,
               bias_values=bias_values, bad_words=bad)
    return {name: t.to(device) for name, t in out.items()}


def process(seqs, logits: torch.Tensor, drafts: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``logits`` ``[B, W, V]`` at positions ``start``..``start+W-1`` of a round whose drafts are ``drafts``
    ``[B, >= start+W-1]`` (position j follows the pending token and drafts 1..j), processed for the kinds in
    ``seqs.processors`` (a new tensor; rows that use none keep their values bit for bit). ``start`` > 0 serves a
    drafter processing its own distribution one position at a time. Half-precision logits are processed in float32,
    as Hugging Face's ``generate`` does (counts stay exact)."""
    used = seqs.processors
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    b, w, v = x.shape
    if BIAS in used:
        bias = torch.zeros(b, v, dtype=x.dtype, device=x.device)
        ids = seqs.bias_ids
        bias.scatter_add_(1, ids.clamp(0, v - 1), torch.where(ids >= 0, seqs.bias_values.to(x.dtype), 0))
        x = x + bias[:, None, :]
    if BAD_WORDS in used or MIN_TOKENS in used:
        banned = torch.zeros(b, w, v, dtype=x.dtype, device=x.device)  # > 0: masked
        if BAD_WORDS in used:
            word_ends, hit = _bad_words(seqs, drafts[:, : start + w - 1], start)
            banned.scatter_add_(2, word_ends.clamp(0, v - 1), hit.to(x.dtype))
        if MIN_TOKENS in used:
            emitted = seqs.generated()[:, None] + torch.arange(start, start + w, device=x.device)
            early = emitted < seqs.min_tokens[:, None]
            stop = seqs.stop[:, None, :].expand(b, w, -1)
            banned.scatter_add_(2, stop.clamp(0, v - 1), ((stop >= 0) & early[..., None]).to(x.dtype))
        x = x.masked_fill(banned > 0, float("-inf"))
    if REPETITION in used or PENALTIES in used:
        x = _penalise(seqs, x, drafts, start)
    return x


def _counts(seqs, v: int, dtype, output: bool) -> torch.Tensor:
    """``[B, V]`` occurrences of each token in each row's output (``output``) or prompt, by one scatter over the
    history (rebuilt each round, so rows joining, leaving or moving between windows need no upkeep)."""
    hist = seqs.history
    col = torch.arange(hist.shape[1], device=hist.device)[None, :]
    start = seqs.prompt_len[:, None]
    mask = (col >= start) & (col < seqs.length[:, None]) if output else col < start
    counts = torch.zeros(hist.shape[0], v, dtype=dtype, device=hist.device)
    return counts.scatter_add_(1, hist.clamp(0, v - 1), mask.to(dtype))


def _penalise(seqs, x: torch.Tensor, drafts: torch.Tensor, start: int) -> torch.Tensor:
    """Repetition, frequency and presence penalties with counts that include the drafts before each position."""
    b, w, v = x.shape
    output = _counts(seqs, v, x.dtype, True)
    if start:  # drafts 1..start come before every position here
        ids = drafts[:, :start].clamp(0, v - 1)
        output = output.scatter_add(1, ids, torch.ones_like(ids, dtype=x.dtype))
    before = torch.zeros(b, w, v, dtype=x.dtype, device=x.device)  # and drafts start+1..j at position j
    if w > 1:
        ids = drafts[:, start : start + w - 1].clamp(0, v - 1)[..., None]
        before[:, 1:].scatter_add_(2, ids, torch.ones_like(ids, dtype=x.dtype))
    output = output[:, None, :] + before.cumsum(1)
    if REPETITION in seqs.processors:
        seen = (output + _counts(seqs, v, x.dtype, False)[:, None, :]) > 0
        p = seqs.repetition.to(x.dtype)[:, None, None]
        x = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    if PENALTIES in seqs.processors:
        x = x - seqs.frequency.to(x.dtype)[:, None, None] * output
        x = x - seqs.presence.to(x.dtype)[:, None, None] * (output > 0).to(x.dtype)
    return x


def _bad_words(seqs, drafts: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bad word's last token ``[B, W, N]`` and whether the tokens before position j (``start``..``start+W-1``;
    ``drafts`` the ones before the last of them) end with the rest of the word (a one-token word: always)."""
    words = seqs.bad_words  # [B, N, L]
    b, n, length = words.shape
    size = (words >= 0).sum(-1)  # [B, N]
    last = words.gather(2, (size - 1).clamp(min=0)[..., None]).squeeze(-1)
    w = drafts.shape[1] + 1 - start
    if length == 1:
        return last[:, None, :].expand(b, w, n), (size > 0)[:, None, :].expand(b, w, n)
    # the L-1 tokens before each position: the history's last ones, then the drafts
    back = seqs.length[:, None] - (length - 1) + torch.arange(length - 1, device=words.device)[None, :]
    tail = seqs.history.gather(1, back.clamp(min=0)).masked_fill(back < 0, -3)
    context = torch.cat([tail, drafts], 1).unfold(1, length - 1, 1)[:, start:]  # [B, W, L-1]
    # word token i sits at column L - size + i of the context window; columns before the word match anything
    i = torch.arange(length - 1, device=words.device)[None, None, :] - (length - size)[..., None]  # [B, N, L-1]
    want = words.gather(2, i.clamp(0, length - 1))
    care = (i >= 0) & (i < (size - 1)[..., None])
    match = (context[:, :, None, :] == want[:, None]) | ~care[:, None]
    return last[:, None, :].expand(b, w, n), match.all(-1) & (size > 0)[:, None, :]
