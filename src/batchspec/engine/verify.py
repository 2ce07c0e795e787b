"""Verification: which draft tokens the target accepts, and the bonus token (always the target's)."""

import torch

from ..sampling import draw


def greedy_accept(target_ids: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor):
    """``target_ids`` [B, K+1]: the target's argmax after the pending token and each draft token.

    Accept the longest prefix of ``drafts`` [B, K] (at most ``n_drafts`` [B]) equal to the target's choices; the bonus
    token is the target's argmax at the first mismatch, or after the last accepted draft. Returns (accepted [B],
    bonus [B]): a row emits ``accepted + 1`` tokens.
    """
    k = drafts.shape[1]
    if not k:  # a plain step: the target's token (a round's few tensor operations cost ~1% of a batch-1 step on a CPU)
        return torch.zeros_like(n_drafts, dtype=torch.long), target_ids[:, 0]
    usable = torch.arange(k, device=drafts.device)[None, :] < n_drafts[:, None]
    match = (drafts == target_ids[:, :k]) & usable
    accepted = match.long().cumprod(1).sum(1)
    bonus = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


def emitted_block(drafts: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: the accepted drafts followed by the bonus token (entries after it are meaningless)."""
    if not drafts.shape[1]:
        return bonus[:, None]
    block = torch.cat([drafts, drafts.new_zeros((drafts.shape[0], 1))], 1)
    return block.scatter(1, accepted[:, None], bonus[:, None])


def rejection_sample(p: torch.Tensor, q, drafts: torch.Tensor, n_drafts: torch.Tensor, u_accept: torch.Tensor,
                     u_target: torch.Tensor, residual: str = "p-q"):
    """Speculative sampling. ``p`` [B, K+1, V]: the target's warped distributions after the pending token and each
    draft token; ``q`` [B, K, V]: the drafter's, or None for a deterministic drafter (one-hot on its tokens).

    Draft ``x`` at step ``j`` is accepted when ``u_accept[:, j] * q(x) < p(x)`` (probability ``min(1, p/q)``). At the
    first rejection the replacement is drawn from ``normalise(max(0, p - q))``; after full acceptance the bonus token
    is drawn from ``p``; both with ``u_target`` at that step. ``residual`` exists for injected faults only:
    ``"q"`` draws the replacement from the draft distribution, ``"p"`` from the target's without subtracting ``q``.
    Returns (accepted [B], bonus [B]) like ``greedy_accept``.
    """
    b, k = drafts.shape
    usable = torch.arange(k, device=drafts.device)[None, :] < n_drafts[:, None]
    px = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    qx = torch.ones_like(px) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    ok = (u_accept[:, :k] * qx < px) & usable
    accepted = ok.long().cumprod(1).sum(1)
    at = accepted[:, None, None]
    p_at = p.gather(1, at.expand(b, 1, p.shape[-1])).squeeze(1)
    rejected = accepted < n_drafts
    if k:
        j = at.clamp(max=k - 1)
        if q is None:
            q_at = torch.zeros_like(p_at).scatter(-1, drafts.gather(1, j[:, :, 0]), 1.0)
        else:
            q_at = q.gather(1, j.expand(b, 1, q.shape[-1])).squeeze(1)
        fix = (p_at - q_at).clamp(min=0) if residual == "p-q" else q_at if residual == "q" else p_at
        fix = torch.where(fix.sum(-1, keepdim=True) > 0, fix, p_at)  # p == q: a rejection had probability 0
        p_at = torch.where(rejected[:, None], fix, p_at)
    bonus = draw(p_at, u_target.gather(1, accepted[:, None]).squeeze(1))
    return accepted, bonus
