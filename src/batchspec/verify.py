"""Verification: which draft tokens the target accepts, and the bonus token (always the target's)."""

import torch


def greedy_accept(target_ids: torch.Tensor, drafts: torch.Tensor, n_drafts: torch.Tensor):
    """``target_ids`` [B, K+1]: the target's argmax after the pending token and each draft token.

    Accept the longest prefix of ``drafts`` [B, K] (at most ``n_drafts`` [B]) equal to the target's choices; the bonus
    token is the target's argmax at the first mismatch, or after the last accepted draft. Returns (accepted [B],
    bonus [B]): a row emits ``accepted + 1`` tokens.
    """
    k = drafts.shape[1]
    usable = torch.arange(k, device=drafts.device)[None, :] < n_drafts[:, None]
    match = (drafts == target_ids[:, :k]) & usable
    accepted = match.long().cumprod(1).sum(1)
    bonus = target_ids.gather(1, accepted[:, None]).squeeze(1)
    return accepted, bonus


def emitted_block(drafts: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[B, K+1]: the accepted drafts followed by the bonus token (entries after it are meaningless)."""
    block = torch.cat([drafts, drafts.new_zeros((drafts.shape[0], 1))], 1)
    return block.scatter(1, accepted[:, None], bonus[:, None])
