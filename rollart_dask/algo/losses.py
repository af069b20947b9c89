"""Policy losses on padded token tensors (pure torch), chosen by ``trainer.loss``.

A loss is ``fn(logp, old_logp, advantages, mask, clip, entropy, entropy_coef) -> (loss, stats)``:
the trainer calls the configured one with those keywords on every micro-batch.
"""
from __future__ import annotations

import torch

from rollart_dask.registries import Registry

LOSSES = Registry("loss")
register_loss = LOSSES.register  # @register_loss("name")


def masked_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, allowed: torch.Tensor | None, temperature: float):
    """Log-prob of each target token and the entropy of the distribution it was sampled from.

    logits [N, T, V]; targets [N, T]; allowed [N, T, V] bool (None = full vocabulary). When decoding
    was constrained, the behaviour distribution is the softmax over the allowed ids only, so the
    trainer must use the same restriction or the PPO ratio compares different distributions.
    """
    logits = logits.float() / temperature
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * logp_all.nan_to_num(neginf=0.0)).sum(-1)
    return logp, entropy


@register_loss("ppo_clip")
def ppo_clip_loss(logp, old_logp, advantages, mask, clip: float, entropy=None, entropy_coef: float = 0.0):
    """Token-level PPO-clip loss (GRPO): every response token of the batch weighs the same.

    logp, old_logp, mask: [N, T]; advantages: [N] (one per sample, broadcast over its tokens).
    Returns (loss, stats).
    """
    mask = mask.float()
    ntok = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    pg_loss = -(surr * mask).sum() / ntok
    loss = pg_loss
    stats = {"pg_loss": pg_loss.item()}
    if entropy is not None:
        ent = (entropy * mask).sum() / ntok
        loss = loss - entropy_coef * ent
        stats["entropy"] = ent.item()
    with torch.no_grad():
        stats["clip_frac"] = (((ratio - 1).abs() > clip).float() * mask).sum().item() / ntok.item()
        stats["ratio_mean"] = ((ratio * mask).sum() / ntok).item()
        stats["approx_kl"] = (((ratio - 1) - (logp - old_logp)) * mask).sum().item() / ntok.item()
    return loss, stats
