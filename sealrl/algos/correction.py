"""Rollout correction: the sampler (inference engine) and the trainer disagree on log-probs.

Even on identical weights, an inference engine (kernels, precision, batching) samples from
pi_rollout, not from the pi_old the trainer recomputes. The PPO ratio pi/pi_old then corrects
for the wrong distribution. Following Yao et al. 2025 ("Your efficient RL framework secretly
brings you off-policy RL training", fengyao.notion.site/off-policy-rl) the fix is importance
sampling from pi_rollout to pi_old, truncated (TIS), or masking out samples that are too far
off (MIS / rejection):

    w_t = min(pi_old(y_t) / pi_rollout(y_t), cap)                    token level
    w_i = min(prod_t pi_old(y_t) / pi_rollout(y_t), cap)             sequence level

All outputs here are detached: they re-weight or select, they are never differentiated.
Tokens were sampled by pi_rollout, so divergences estimate KL(pi_rollout || pi_old), with the
estimators of `sealrl.algos.kl` (k1 can be negative per token; k2, k3 >= 0).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from sealrl.algos.kl import KL_ESTIMATORS

LEVELS = ("token", "sequence")


# algorithm.correction: how the actor corrects for rollout-vs-trainer mismatch
CORRECTIONS = ("none", "token_is", "seq_is", "token_reject", "seq_reject")


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def importance_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor,
                       level: str = "token", cap: float = 2.0) -> Tensor:
    """Truncated importance weights pi_old / pi_rollout (TIS, Yao et al. 2025).

        token:     w_t = min(exp(old_t - rollout_t), cap)
        sequence:  w_t = min(exp(sum_{s valid} (old_s - rollout_s)), cap)   same for every token

    old_log_prob, rollout_log_prob, response_mask (B, T) -> (B, T), detached, 0 at padding.
    Multiply into the policy loss (`is_weights=` of the losses). Capping happens in log space,
    so a huge log-ratio cannot overflow.
    """
    _check_level(level)
    if not cap > 0:
        raise ValueError(f"importance_weights: cap must be > 0, got {cap!r}")
    m = response_mask.bool()
    zero = torch.zeros_like(old_log_prob)
    log_ratio = torch.where(m, old_log_prob - rollout_log_prob, zero).detach()
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    weights = log_ratio.clamp(max=math.log(cap)).exp()
    return torch.where(m, weights, zero)


def rejection_mask(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor,
                   level: str = "token", kind: str = "k3", *, threshold: float) -> Tensor:
    """Keep-mask of tokens whose rollout / trainer divergence is acceptable (MIS-style rejection).

        d_t    = kind-estimate of KL(pi_rollout || pi_old) at token t
                 k1 = rollout_t - old_t;  k2 = 0.5 (old_t - rollout_t)^2;  k3 = e^x - 1 - x, x = old_t - rollout_t
        token:     keep_t = valid_t and d_t <= threshold
        sequence:  keep_t = valid_t and mean_{s valid} d_s <= threshold   (whole sequence kept or not)

    (B, T) -> (B, T) bool. AND it into the response mask *before* building the loss normaliser,
    so rejected tokens are not counted either.
    """
    _check_level(level)
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"rejection_mask: kind must be 'k1', 'k2' or 'k3', got {kind!r}")
    m = response_mask.bool()
    zero = torch.zeros_like(old_log_prob)
    div = torch.where(m, KL_ESTIMATORS[kind](rollout_log_prob.detach(), old_log_prob.detach()), zero)
    if level == "sequence":
        div = (div.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(div)
    return m & (div <= threshold)


def correction_metrics(candidates: Tensor, kept: Tensor | None, weights: Tensor | None) -> dict[str, Tensor]:
    """What the correction did to the loss. candidates: the tokens that may take part in the
    loss before rejection, (B, T) bool; kept: those left after rejection (B, T) bool, or None
    (no rejection: all kept); weights: the IS weights (B, T), or None. Detached float64 0-dim:
      rejected_token_frac   1 - |kept| / |candidates|
      rejected_seq_frac     rows with a candidate rejected / rows with a candidate
      is_weight_mean, _max, _min   of the weights over kept tokens (only when weights are given;
                            1 when nothing is kept)
    The rejection keys only when kept is given."""
    c = candidates.bool()
    k = c if kept is None else kept.bool()
    out: dict[str, Tensor] = {}
    if kept is not None:
        rows = c.any(-1)
        lost = (c & ~k).any(-1)
        out["rejected_token_frac"] = 1.0 - k.sum().double() / c.sum().clamp(min=1)
        out["rejected_seq_frac"] = lost.sum().double() / rows.sum().clamp(min=1)
    if weights is not None:
        w = weights.detach().double()[k]
        if w.numel() == 0:
            w = torch.ones(1, dtype=torch.float64)
        out.update(is_weight_mean=w.mean(), is_weight_max=w.max(), is_weight_min=w.min())
    return out


def mismatch_metrics(log_prob: Tensor, rollout_log_prob: Tensor,
                     response_mask: Tensor) -> dict[str, Tensor]:
    """How far the trainer's log-probs are from the sampler's, on the sampled tokens.

    log_prob (trainer, usually old_log_prob), rollout_log_prob, response_mask (B, T) ->
    dict of detached float32 0-dim tensors, means over valid tokens of the batch given:
      k1                     mean(rollout - log_prob), KL(rollout || trainer), can be < 0
      k3                     mean(e^x - 1 - x), x = log_prob - rollout; >= 0
      log_prob_abs_diff_max  max |log_prob - rollout|
      prob_abs_diff_mean     mean |exp(log_prob) - exp(rollout)|
      ppl_train, ppl_rollout exp(-mean log-prob) over all valid tokens
      ppl_ratio              mean over non-empty rows of ppl_train_i / ppl_rollout_i
                             (= exp(mean_t (rollout - log_prob)) per row)
    Nothing valid: every entry 0 except ppl_train = ppl_rollout = 1.
    """
    m = response_mask.bool()
    lp = torch.where(m, log_prob, torch.zeros_like(log_prob)).detach().float()
    rp = torch.where(m, rollout_log_prob, torch.zeros_like(rollout_log_prob)).detach().float()
    count = m.sum().clamp(min=1)
    x = (lp - rp).clamp(-20.0, 20.0)  # 0 at padding
    row_count = m.sum(-1)
    rows = row_count > 0
    row_ratio = ((rp - lp).sum(-1) / row_count.clamp(min=1)).clamp(-20.0, 20.0).exp()
    return {
        "k1": (rp - lp).sum() / count,
        "k3": (x.exp() - 1 - x).sum() / count,
        "log_prob_abs_diff_max": (lp - rp).abs().max(),
        "prob_abs_diff_mean": torch.where(m, (lp.exp() - rp.exp()).abs(), 0.0).sum() / count,
        "ppl_train": (-lp.sum() / count).exp(),
        "ppl_rollout": (-rp.sum() / count).exp(),
        "ppl_ratio": torch.where(rows, row_ratio, 0.0).sum() / rows.sum().clamp(min=1),
    }
