"""Why an output diverged: numerical noise, a synchronisation error or a wrong reference, and which bug class it looks
like.

Margin rule. At an output's first divergent index ``j`` the target alone, at batch size 1, reads the prompt plus the
oracle's first ``j`` tokens; the *margin* is its logit for the oracle's token minus its logit for the engine's token.
A correct engine only picks another token where the two are (nearly) tied, and the oracle, being the target's own
greedy choice, is never beaten by the engine's token beyond rounding, so::

    |margin| <= tolerance  ->  "numerical"        tolerance = rel[dtype] * max(1, max |logit|) at that position
    margin > tolerance     ->  "synchronization"
    margin < -tolerance    ->  "reference"        the target prefers the engine's token: the oracle is wrong

``rel`` defaults to ``DEFAULT_TOLERANCE`` (float64 1e-6, float32 1e-5, float16 2e-2, bfloat16 5e-2) and is looked up
for the less precise of the oracle's and the engine's dtypes. float64 is not tighter because HF ``generate`` rounds
the logits to float32 before its argmax, so the oracle itself cannot tell apart two logits closer than float32
rounding (about 1e-7 of the logit scale). A length difference with no differing token (an output
that stops early without a stop token, or runs on) has no margin and counts as synchronization.

Overrun (the endpoint audit, which compares the whole output a server returns): tokens after the output's first stop
token or beyond ``max_tokens`` are one divergence of class ``"overrun"`` at the first extra token, with no margin; a
row with one is never clean, and its signature is ``overrun`` unless a synchronization divergence names another.

Signature rules (exactly one per engine and batch size), in order:

``stale or wrong reference``: some divergence is of class "reference": the oracle output is not what the target
decodes (a stale cache, another model, another attention implementation), so it cannot judge the engine.

``clean``: no synchronization divergence.

White-box (batchspec engines): the diverging batches are rerun with ``check_invariants=True``; the first violated
invariant decides: ``positions`` -> ``position-id misalignment``; ``content``, ``count`` or ``shape`` -> ``kv-cache
drift``; ``padding`` -> ``padding leakage``; no violation -> ``acceptance-rule error`` (the caches stay consistent, so
the wrong tokens came from the acceptance step).

Black-box (any other engine), over the outputs with a synchronization divergence:

1. ``padding leakage`` when the batch size is > 1, every such output came from a padded row (a prompt shorter than the
   longest of its batch) and each of those prompts decodes cleanly when the engine runs it alone;
2. ``position-id misalignment`` when their mean partial match is below ``IMMEDIATE`` (0.25): immediate divergence;
3. ``kv-cache drift`` when at least half of them end in a repetition loop that their oracle output does not end in
   (a long correct prefix, then repetition);
4. ``unknown`` otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

REFERENCE = "stale or wrong reference"
OVERRUN = "overrun"  # a divergence class and a signature: tokens past the first stop token or max_tokens

SIGNATURES = (
    "clean", "position-id misalignment", "kv-cache drift", "acceptance-rule error", "padding leakage", "unknown",
    REFERENCE,
)

# float32: about 80 units in the last place (eps 1.2e-7) of the logit scale. A correct float32 engine computes the
# same sums as the oracle in another order (other batch shapes, other kernels), which moves logits by a few units in
# the last place of their scale, so its near ties lie within ~1e-6 of it; a looser 1e-3 (0.03 on a logit scale of 30)
# let injected faults whose margins were a few hundredths pass as near ties.
DEFAULT_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}

IMMEDIATE = 0.25  # mean partial match below which a black-box divergence counts as immediate

INVARIANT_SIGNATURE = {
    "positions": "position-id misalignment",
    "content": "kv-cache drift",
    "count": "kv-cache drift",
    "shape": "kv-cache drift",
    "padding": "padding leakage",
}


def _dtype(d):
    if isinstance(d, str):
        return getattr(torch, d.removeprefix("torch."))
    return d


def coarser(*dtypes) -> torch.dtype:
    """The least precise of the given floating dtypes (None entries ignored)."""
    ds = [_dtype(d) for d in dtypes if d is not None]
    return max(ds, key=lambda d: torch.finfo(d).eps)


def relative_tolerance(dtype, tolerance=None) -> float:
    """``tolerance``: None (the defaults), a number (used for every dtype), or a dict of dtype (or name) -> number
    overriding some defaults."""
    dtype = _dtype(dtype)
    if isinstance(tolerance, (int, float)):
        return float(tolerance)
    table = dict(DEFAULT_TOLERANCE)
    if tolerance:
        table.update({_dtype(k): float(v) for k, v in tolerance.items()})
    if dtype in table:
        return table[dtype]
    return 10 * torch.finfo(dtype).eps  # an unlisted dtype: ten units in the last place


def classify(margin: float | None, tolerance: float) -> str:
    """"numerical" when the target's preference between the two tokens is within ``tolerance``; "synchronization"
    when it prefers the oracle's token beyond it (or there is no margin); "reference" when it prefers the engine's."""
    if margin is None or margin > tolerance:
        return "synchronization"
    return "reference" if margin < -tolerance else "numerical"


@dataclass
class Divergence:
    prompt: int  # index into the audited prompts
    index: int  # first divergent token index
    margin: float | None  # target logit of the oracle's token minus that of the engine's token
    tolerance: float | None
    cls: str  # "numerical" | "synchronization" | "reference" | "overrun"
    oracle_token: int | None
    engine_token: int | None

    def as_dict(self) -> dict:
        return {
            "prompt": self.prompt, "index": self.index, "margin": self.margin, "tolerance": self.tolerance,
            "class": self.cls, "oracle_token": self.oracle_token, "engine_token": self.engine_token,
        }


class MarginProbe:
    """Target logits at batch size 1 for prompt + oracle prefix, memoised (engines often diverge at the same place)."""

    def __init__(self, model, memo: int = 128):
        self.model, self.memo = model, memo
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self._memo: OrderedDict = OrderedDict()

    @torch.inference_mode()
    def logits(self, prompt: list[int], prefix: list[int]) -> torch.Tensor:
        key = (tuple(prompt), tuple(prefix))
        if key not in self._memo:
            ids = torch.tensor([list(prompt) + list(prefix)], device=self.model.device)
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
            self._memo[key] = out.logits[0, -1].to("cpu", torch.float64)
            if len(self._memo) > self.memo:
                self._memo.popitem(last=False)
        self._memo.move_to_end(key)
        return self._memo[key]

    def divergence(self, i: int, prompt, output, oracle, index: int, rel_tol: float) -> Divergence:
        o_tok = oracle[index] if index < len(oracle) else None
        e_tok = output[index] if index < len(output) else None
        if o_tok is None or e_tok is None:
            return Divergence(i, index, None, None, "synchronization", o_tok, e_tok)
        logits = self.logits(prompt, oracle[:index])
        if not 0 <= e_tok < self.vocab:
            return Divergence(i, index, None, None, "synchronization", o_tok, e_tok)
        margin = float(logits[o_tok] - logits[e_tok])
        tol = rel_tol * max(1.0, float(logits.abs().max()))
        return Divergence(i, index, margin, tol, classify(margin, tol), o_tok, e_tok)


def invariant_kind(err) -> str:
    """The kind of an ``InvariantError``: its ``kind`` attribute, or (older engines) read from its message."""
    kind = getattr(err, "kind", None)
    if kind:
        return kind
    msg = str(err)
    if getattr(err, "invariant", None) == "I1":
        return "shape"
    if "padding" in msg:
        return "padding"
    if "positions" in msg:
        return "positions"
    if "valid KV entries" in msg or "cache is empty" in msg:
        return "count"
    if "did not accept" in msg:
        return "content"
    return "unknown"


def invariant_record(err, batch: list[int]) -> dict:
    return {
        "invariant": getattr(err, "invariant", None), "kind": invariant_kind(err), "row": getattr(err, "row", None),
        "round": getattr(err, "round", None), "cache": getattr(err, "cache", None), "batch": batch,
        "message": str(err),
    }


def white_box_signature(n_sync: int, violation: dict | None, *, n_reference: int = 0) -> str:
    if n_reference:
        return REFERENCE
    if n_sync == 0:
        return "clean"
    if violation is None:
        return "acceptance-rule error"
    return INVARIANT_SIGNATURE.get(violation["kind"], "unknown")


def black_box_signature(
    batch_size: int, sync: list[dict], immediate: float = IMMEDIATE, *, n_reference: int = 0
) -> str:
    """``sync``: one record per output with a synchronization divergence: ``partial_match``, ``padded`` (its prompt
    was shorter than the longest of its batch), ``solo_clean`` (it decodes cleanly alone; None if not checked),
    ``loops`` and ``oracle_loops`` (whether it, and its oracle output, end in a repetition loop). ``n_reference``:
    the number of divergences of class "reference"."""
    if n_reference:
        return REFERENCE
    if not sync:
        return "clean"
    if batch_size > 1 and all(r["padded"] and r.get("solo_clean") for r in sync):
        return "padding leakage"
    if sum(r["partial_match"] for r in sync) / len(sync) < immediate:
        return "position-id misalignment"
    if 2 * sum(r["loops"] and not r["oracle_loops"] for r in sync) >= len(sync):
        return "kv-cache drift"
    return "unknown"
