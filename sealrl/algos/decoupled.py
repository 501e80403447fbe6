"""The decoupled PPO objective for stale (asynchronous) experience: the policy that sampled the
tokens (behaviour) is not the one whose trust region the update respects (proximal).

Hilton, Cobbe & Schulman 2022 ("Batch size-invariance for policy optimization",
arXiv:2110.00641, section 3) split PPO's pi_old in two; AReaL (Fu et al. 2025,
arXiv:2505.24298, eq. 5) uses it for asynchronous RL with the proximal policy recomputed by the
actor before the update:

    w_t = min(pi_prox(y_t) / pi_behav(y_t), cap)           truncated importance weight (detached)
    r_t = pi(y_t) / pi_prox(y_t)                           trust-region ratio
    l_t = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
    loss = aggregate(l, response_mask, normaliser)

In sealrl, behaviour = `rollout_log_probs` (stamped with the sampling version) and proximal =
`old_log_probs` recomputed by the actor consuming the batch (stamped with its version): with
rollout.max_staleness > 0 and algorithm.correction=token_is (seq_is: one weight per sequence)
the actor's clipped loss is exactly this function. When behaviour and proximal coincide
(staleness 0, no sampler/trainer mismatch) every w_t is 1 and it is the synchronous PPO loss.
"""
from __future__ import annotations

from torch import Tensor

from sealrl.algos.correction import importance_weights
from sealrl.algos.losses import LossNormaliser, ppo_clip_loss


def decoupled_ppo_loss(log_prob: Tensor, proximal_log_prob: Tensor, behaviour_log_prob: Tensor,
                       advantages: Tensor, response_mask: Tensor, normaliser: LossNormaliser,
                       clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                       cap: float = 2.0, level: str = "token") -> tuple[Tensor, dict[str, Tensor]]:
    """(loss 0-dim, metrics) of the formulas above; all inputs (b, T), log_prob with gradient.
    Metrics: those of `ppo_clip_loss` (its ratio is pi / pi_prox) plus `is_weight_mean` and
    `is_weight_max` over the valid tokens."""
    weights = importance_weights(proximal_log_prob, behaviour_log_prob, response_mask, level=level, cap=cap)
    loss, metrics = ppo_clip_loss(log_prob, proximal_log_prob, advantages, response_mask, normaliser,
                                  clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, is_weights=weights)
    valid = weights[response_mask.bool()]
    metrics["is_weight_mean"] = valid.mean() if valid.numel() else weights.new_tensor(1.0)
    metrics["is_weight_max"] = valid.max() if valid.numel() else weights.new_tensor(1.0)
    return loss, metrics
