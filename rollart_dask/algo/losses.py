"""Policy losses on padded token tensors (pure torch), chosen by ``trainer.loss``.

A loss is ``fn(logp, old_logp, advantages, mask, clip, entropy, entropy_coef, is_weights, token_weights) -> (loss, stats)``
(``is_weights``: the off-policy correction's per-token behaviour weights, or None; ``off_policy`` below;
``token_weights``: each token's weight in the policy term, ``aggregation_weights`` below, or None: the token mean):
the trainer calls the configured one with those keywords on every micro-batch.
"""

from __future__ import annotations

import torch

from rollart_dask.registry import Registry

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


def aggregation_weights(mask: torch.Tensor, agg: str, n_samples: int, total_tokens: int, norm_tokens: int) -> torch.Tensor:
    """Per-token weights [N, T] of one micro-batch's policy term for ``trainer.loss_agg``.

    The trainer scales each micro-batch's loss by its share of the batch's response tokens (n_c / total_tokens), so
    these are the batch weights divided by that share: the sum over micro-batches is then the batch's aggregate
    whatever the cut. Batch weights: token_mean 1 / total_tokens; seq_mean 1 / (n_samples × the sample's length);
    constant 1 / (n_samples × norm_tokens)."""
    m = mask.float()
    ntok = m.sum().clamp(min=1.0)
    if agg == "token_mean":
        return m / ntok
    share = ntok / max(total_tokens, 1)
    if agg == "seq_mean":
        per = 1.0 / (n_samples * m.sum(-1, keepdim=True).clamp(min=1.0))
    elif agg == "constant":
        per = torch.full_like(m[:, :1], 1.0 / (n_samples * norm_tokens))
    else:
        raise ValueError(f"trainer.loss_agg: {agg!r} is not one of token_mean, seq_mean, constant")
    return m * per / share


@register_loss("ppo_clip")
def ppo_clip_loss(
    logp, old_logp, advantages, mask, clip: float, entropy=None, entropy_coef: float = 0.0, is_weights=None, token_weights=None
):
    """PPO-clip loss (GRPO) whose token losses are aggregated by ``token_weights`` (None: every token of ``mask`` weighs the same).

    logp, old_logp, mask: [N, T]; advantages: [N] (one per sample, broadcast over its tokens); is_weights [N, T]
    (an off-policy correction's behaviour weights, ``off_policy``) multiply each token's clipped surrogate;
    token_weights [N, T] (``aggregation_weights``, from the mask before any token was dropped, so that dropping keeps
    the denominators). The entropy bonus and the stats are token means over ``mask``. Returns (loss, stats).
    """
    mask = mask.float()
    ntok = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    if is_weights is not None:
        surr = surr * is_weights
    if token_weights is None:
        pg_loss = -(surr * mask).sum() / ntok
    else:
        pg_loss = -(surr * mask * token_weights).sum()
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


def off_policy(
    correction: str, logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float, level: str = "token"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, dict]:
    """What the PPO loss compares against, per ``trainer.correction``: returns (old_logp, is_weights, mask, stats).

    ``none``: the behaviour policy's log-probs (the engines' at generation), the PPO ratio π_θ / π_behaviour.
    Otherwise the ratio is against the proximal policy — the trainer's own weights before this update (``logp``
    detached: one optimizer step per batch) — and each token carries the behaviour weight w = π_prox / π_behaviour:
    ``tis`` truncates it at ``cap`` (``level`` token: per token; sequence: the product over the response, one weight
    per sample); ``decoupled`` (decoupled PPO) keeps it and drops the tokens whose w exceeds ``cap``. On on-policy
    data w = 1. Stats: mean w before truncation, its 99th percentile, the share of tokens truncated or dropped."""
    if correction == "none":
        return behaviour_logp, None, mask, {}
    prox = logp.detach()
    m = mask.bool()
    log_w = (prox - behaviour_logp).masked_fill(~m, 0.0)
    if correction == "tis" and level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w.clamp(max=30.0))  # (a weight beyond e^30 is truncated or dropped all the same)
    over = (w > cap) & m
    if correction == "tis":
        weights, kept = w.clamp(max=cap), m
    elif correction == "decoupled":
        weights, kept = w, m & ~over
    else:
        raise ValueError(f"trainer.correction: {correction!r} is not one of none, tis, decoupled")
    n = m.sum().clamp(min=1)
    ws = w[m]
    stats = {
        "is_weight_mean": float(ws.mean()) if ws.numel() else 1.0,
        "is_weight_p99": float(ws.quantile(0.99)) if ws.numel() else 1.0,
        ("is_truncated" if correction == "tis" else "is_dropped"): float(over.sum() / n),
    }
    return prox, weights * kept, kept, stats
