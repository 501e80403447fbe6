"""Policy and value losses, and the one place that decides how token losses become a scalar.

Sign convention: every loss here is to be *minimised* (loss = -objective).

Aggregation is split in two so that gradient accumulation and data parallelism cannot change the
number being optimised:

    norm  = make_normaliser(response_mask_of_the_whole_global_batch, mode, horizon)   # once
    loss  = sum over micro-batches (and ranks) of aggregate(loss_mat_mb, mask_mb, norm)

`aggregate` returns the micro-batch's *share*: summing shares equals one pass over the whole
batch, in value and in gradient. With T_b = valid tokens of row b, N_tok = sum_b T_b and
N_seq = number of rows with at least one valid token (both counted on the global batch):

    token-mean               L = sum_{b,t} m l / N_tok
    seq-mean-token-mean      L = sum_b (sum_t m l / T_b) / N_seq
    seq-mean-token-sum       L = sum_{b,t} m l / N_seq
    seq-mean-token-sum-norm  L = sum_{b,t} m l / (N_seq * H)      Dr.GRPO (Liu et al. 2025,
                                                                  arXiv:2503.20783): H constant
Empty rows contribute 0 and are not counted; all denominators are >= 1, so no NaN.

Driver notes: call `backward()` on each share and do NOT divide by the number of micro-batches.
Under DDP, which *averages* gradients over ranks, multiply each share by the world size (or
all-reduce with a sum). A rank that only holds its shard builds the normaliser from all-reduced
counts: `LossNormaliser(mode, num_tokens=..., num_seqs=..., horizon=...)`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True, slots=True)
class LossNormaliser:
    """Global counts of one batch, fixed before any micro-batch is processed."""

    mode: str
    """one of AGG_MODES"""
    num_tokens: int
    """valid tokens in the whole global batch (N_tok)"""
    num_seqs: int
    """rows with at least one valid token in the whole global batch (N_seq)"""
    horizon: float
    """constant token-sum divisor H of seq-mean-token-sum-norm (e.g. max_new_tokens)"""

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"LossNormaliser.mode must be one of {AGG_MODES}, got {self.mode!r}")
        if self.num_tokens < 0 or self.num_seqs < 0:
            raise ValueError(f"LossNormaliser: counts must be >= 0, got num_tokens="
                             f"{self.num_tokens!r}, num_seqs={self.num_seqs!r}")
        if not self.horizon > 0:
            raise ValueError(f"LossNormaliser.horizon must be > 0, got {self.horizon!r}")


def make_normaliser(response_mask: Tensor, mode: str, horizon: float | None = None) -> LossNormaliser:
    """Count the global batch once. response_mask (B, T) of the WHOLE batch (all micro-batches,
    all ranks). horizon defaults to T, the padded width; pass max_new_tokens to make Dr.GRPO's
    divisor independent of how the batch was padded. Synchronises with the device once."""
    m = response_mask.bool()
    return LossNormaliser(mode=mode, num_tokens=int(m.sum()), num_seqs=int(m.any(-1).sum()),
                          horizon=float(m.shape[-1] if horizon is None else horizon))


def aggregate(loss_mat: Tensor, mask: Tensor, normaliser: LossNormaliser) -> Tensor:
    """This micro-batch's share of the global loss (formulas in the module docstring).

    loss_mat, mask (b, T) -> 0-dim. Padding is selected away with `where`, so a NaN / inf there
    cannot reach the value (losses below also sanitise their inputs so it cannot reach gradients).
    """
    m = mask.bool()
    total = torch.where(m, loss_mat, torch.zeros_like(loss_mat))
    num_seqs = max(normaliser.num_seqs, 1)
    if normaliser.mode == "token-mean":
        return total.sum() / max(normaliser.num_tokens, 1)
    if normaliser.mode == "seq-mean-token-mean":
        return (total.sum(-1) / m.sum(-1).clamp(min=1)).sum() / num_seqs
    if normaliser.mode == "seq-mean-token-sum":
        return total.sum() / num_seqs
    return total.sum() / (num_seqs * normaliser.horizon)  # seq-mean-token-sum-norm


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    """Detached mean of x over m (0 when m is empty). Used for metrics only."""
    x = x.detach().to(torch.float32)
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def _clipped_surrogate(ratio: Tensor, adv: Tensor, m: Tensor, clip_low: float, clip_high: float,
                       dual_clip: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped surrogate loss and its clip fractions (shared by PPO and GSPO)."""
    if clip_low < 0 or clip_high < 0 or clip_low >= 1:
        raise ValueError(f"clip bounds need 0 <= clip_low < 1 and clip_high >= 0, "
                         f"got clip_low={clip_low!r}, clip_high={clip_high!r}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip!r}")
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_low, 1 + clip_high))
    upper = (adv > 0) & (ratio > 1 + clip_high)  # clip binds: no gradient pushing ratio up
    lower = (adv < 0) & (ratio < 1 - clip_low)
    if dual_clip is not None:
        dual = (adv < 0) & (ratio > dual_clip)
        loss = torch.where(dual, -adv * dual_clip, loss)
    else:
        dual = torch.zeros_like(upper)
    metrics = {"clip_frac_upper": _masked_mean(upper & m, m),
               "clip_frac_lower": _masked_mean(lower & m, m),
               "clip_frac_dual": _masked_mean(dual & m, m)}
    return loss, metrics


def _ratio_metrics(ratio: Tensor, token_log_ratio: Tensor, m: Tensor) -> dict[str, Tensor]:
    """approx_kl = k3 estimate of KL(old || new) from tokens sampled by old, mean over valid tokens:
    (r - 1) - log r with r = pi_new / pi_old per token. ratio_mean / ratio_max of `ratio`."""
    r = ratio.detach()
    log_r = token_log_ratio.detach().clamp(-20.0, 20.0)
    return {"approx_kl": _masked_mean(log_r.exp() - 1 - log_r, m),
            "ratio_mean": _masked_mean(r, m),
            "ratio_max": torch.where(m, r, torch.zeros_like(r)).max().float()}


def policy_ratio(log_prob: Tensor, old_log_prob: Tensor, response_mask: Tensor,
                 level: str = "token") -> Tensor:
    """Detached importance ratios pi/pi_old at the valid tokens, 1-D (row-major), as the losses
    see them:
        token     r_t = exp(clamp(log_prob_t - old_t, -20, 20))                  (ppo_clip_loss)
        sequence  s_i = exp(clamp(mean_{t valid} (log_prob_t - old_t), -20, 20)), one per token
                  of row i                                                      (gspo_loss)
    (b, T) inputs -> (number of valid tokens,)."""
    m = response_mask.bool()
    log_ratio = torch.where(m, log_prob.detach() - old_log_prob.detach(), torch.zeros_like(log_prob)).float()
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"policy_ratio: level must be 'token' or 'sequence', got {level!r}")
    return log_ratio.clamp(-20.0, 20.0).exp()[m]


def ratio_stats(ratios: Tensor) -> dict[str, Tensor]:
    """ratio_min, ratio_p50, ratio_p99, ratio_max of a 1-D tensor of ratios (quantiles by linear
    interpolation between order statistics, torch.quantile). Empty: all 1 (nothing moved)."""
    if ratios.numel() == 0:
        return {k: torch.tensor(1.0) for k in ("ratio_min", "ratio_p50", "ratio_p99", "ratio_max")}
    r = ratios.detach().double()
    q = torch.quantile(r, torch.tensor([0.5, 0.99], dtype=torch.float64))
    return {"ratio_min": r.min(), "ratio_p50": q[0], "ratio_p99": q[1], "ratio_max": r.max()}


def ppo_clip_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                  normaliser: LossNormaliser, clip_low: float = 0.2, clip_high: float = 0.2,
                  dual_clip: float | None = None,
                  is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), as a loss.

        r_t    = exp(log_prob - old_log_prob)                  (log-ratio clamped to [-20, 20])
        l_t    = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        l_t    = min(l_t, -A_t * dual_clip)   if A_t < 0      (dual-clip, Ye et al. 2020,
                                                               arXiv:1912.09729, eq. 5)
        l_t   *= is_weights_t                                  (optional rollout correction)
        loss   = aggregate(l, response_mask, normaliser)

    clip_low != clip_high is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476, eq. 10).
    Dual-clip bounds the loss of a negative-advantage token at dual_clip * |A| however large its
    ratio grows (dual_clip > 1).
    log_prob (grad), old_log_prob, advantages, response_mask, is_weights: (b, T).
    Returns (loss 0-dim, metrics). Metrics are detached 0-dim tensors averaged over the valid
    tokens of THIS micro-batch (not the global normaliser):
      clip_frac_upper  A > 0 and r > 1 + clip_high (the clip binds)
      clip_frac_lower  A < 0 and r < 1 - clip_low
      clip_frac_dual   A < 0 and r > dual_clip (0 when dual_clip is None)
      approx_kl        k3 estimate of KL(old || new); ratio_mean, ratio_max
    """
    m = response_mask.bool()
    zero = torch.zeros_like(log_prob)
    log_ratio = torch.where(m, log_prob - old_log_prob, zero).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()  # (b, T), 1 at padding
    adv = torch.where(m, advantages, zero)
    loss_mat, metrics = _clipped_surrogate(ratio, adv, m, clip_low, clip_high, dual_clip)
    if is_weights is not None:
        loss_mat = loss_mat * torch.where(m, is_weights, zero)
    metrics.update(_ratio_metrics(ratio, log_ratio, m))
    return aggregate(loss_mat, m, normaliser), metrics


def gspo_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
              normaliser: LossNormaliser, clip_low: float = 3e-4, clip_high: float = 4e-4,
              is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071, eq. 5-7, 13-14).

        s_i    = exp( (1/|y_i|) sum_t (log_prob - old_log_prob) )   sequence-level ratio
        l_i    = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))

    Token form used here (GSPO-token, eq. 13): s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose
    value is s_i and whose gradient is s_i * grad log pi(y_t). With per-token advantages all equal
    to A_i and the "seq-mean-token-mean" normaliser this is exactly GSPO: mean over sequences of
    (1/|y_i|) sum_t, and grad s_i = s_i (1/|y_i|) sum_t grad log pi(y_t). Other modes re-weight
    sequences by length (documented choice of the caller). Per-token advantages give GSPO-token.
    Default clip range 3e-4 / 4e-4 is the paper's (ratios of *geometric means* are near 1).
    Shapes as `ppo_clip_loss`; advantages (b, T) (broadcast per-sequence ones with
    `broadcast_to_tokens`). Metrics: same names as PPO, token-weighted (every token of a
    sequence carries its sequence's ratio); approx_kl is the per-token k3 of old vs new.
    """
    m = response_mask.bool()
    zero = torch.zeros_like(log_prob)
    log_ratio = torch.where(m, log_prob - old_log_prob, zero)  # (b, T)
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)  # (b,)
    # value: log s_i (clamped so exp cannot overflow); gradient: that of log_prob at each token
    tok_log_ratio = (seq_log_ratio.detach().clamp(-20.0, 20.0).unsqueeze(-1)
                     + log_prob - log_prob.detach())
    tok_log_ratio = torch.where(m, tok_log_ratio, zero)
    ratio = tok_log_ratio.exp()
    adv = torch.where(m, advantages, zero)
    loss_mat, metrics = _clipped_surrogate(ratio, adv, m, clip_low, clip_high, None)
    if is_weights is not None:
        loss_mat = loss_mat * torch.where(m, is_weights, zero)
    metrics.update(_ratio_metrics(ratio, log_ratio, m))
    return aggregate(loss_mat, m, normaliser), metrics


def policy_gradient_loss(log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                         normaliser: LossNormaliser,
                         is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Vanilla policy gradient (REINFORCE, Williams 1992): l_t = -A_t * log_prob_t (* is_weights_t).

    (b, T) inputs -> (loss 0-dim, {}). The metrics dict is empty; it is returned so that every
    policy loss has the same return type.
    """
    m = response_mask.bool()
    zero = torch.zeros_like(log_prob)
    loss_mat = -torch.where(m, advantages, zero) * torch.where(m, log_prob, zero)
    if is_weights is not None:
        loss_mat = loss_mat * torch.where(m, is_weights, zero)
    return aggregate(loss_mat, m, normaliser), {}


def _pg_loss_uniform(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                     response_mask: Tensor, normaliser: LossNormaliser,
                     is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """`policy_gradient_loss` with the uniform signature; old_log_prob is ignored."""
    return policy_gradient_loss(log_prob, advantages, response_mask, normaliser, is_weights)


# The table of every policy loss, POLICY_LOSSES, is in sealrl.algos.surrogates.


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor,
               normaliser: LossNormaliser,
               clip_eps: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2 baselines; Andrychowicz et al. 2020 discuss it, arXiv:2006.05990).

        V_clip = old_values + clip(values - old_values, -clip_eps, clip_eps)
        l_t    = 0.5 * max((values - R)^2, (V_clip - R)^2)     (clip_eps None: 0.5 (values - R)^2)

    The 0.5 makes the gradient (V - R). values (grad), old_values, returns, response_mask (b, T).
    Returns (loss 0-dim, {"value_clip_frac": fraction of valid tokens of this micro-batch where
    the clipped term is the larger one}).
    """
    m = response_mask.bool()
    zero = torch.zeros_like(values)
    returns = torch.where(m, returns, zero)
    values = torch.where(m, values, zero)
    err = (values - returns).pow(2)
    if clip_eps is None:
        return aggregate(0.5 * err, m, normaliser), {"value_clip_frac": _masked_mean(zero, m)}
    old = torch.where(m, old_values, zero)
    v_clip = old + (values - old).clamp(-clip_eps, clip_eps)
    err_clip = (v_clip - returns).pow(2)
    loss_mat = 0.5 * torch.maximum(err, err_clip)
    return aggregate(loss_mat, m, normaliser), {"value_clip_frac": _masked_mean(err_clip > err, m)}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last axis:  H = logsumexp(z) - sum_v softmax(z)_v z_v.

    (..., V) -> (...). Stable for large logits (max-shift + logsumexp) and for -inf logits (filtered
    vocab): those get p = 0 and are zeroed before the product, so neither value nor gradient is
    NaN. Materialises the (..., V) probabilities: chunk over tokens for large vocabularies.
    """
    # shift by the max first: H is shift-invariant, and lse(z) - sum p z would otherwise
    # subtract two numbers of the size of the logits (catastrophic cancellation)
    z = logits - logits.detach().amax(dim=-1, keepdim=True)
    p = torch.softmax(z, dim=-1)
    z_finite = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    return torch.logsumexp(z, dim=-1) - (p * z_finite).sum(-1)
