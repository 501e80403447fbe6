"""More policy losses, as verl users select them (`policy_loss.loss_mode`): SAPO, Clip-Cov,
KL-Cov, geometric-mean PPO (GMPO) and CISPO; and POLICY_LOSSES, the table of every policy loss.

Same contract as `sealrl.algos.losses`: (b, T) inputs, a loss to minimise that is this
micro-batch's share of the global normaliser (`aggregate`), padding selected away with `where`,
optional `is_weights` (rollout correction) multiplied into the per-token loss, and detached
metrics averaged over this micro-batch's valid tokens. r_t = exp(clamp(log_prob_t - old_t,
-20, 20)) throughout.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sealrl.algos.losses import (
    LossNormaliser,
    _clipped_surrogate,
    _masked_mean,
    _pg_loss_uniform,
    _ratio_metrics,
    aggregate,
    gspo_loss,
    ppo_clip_loss,
)


def _ratio(log_prob: Tensor, old_log_prob: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    log_ratio = torch.where(m, log_prob - old_log_prob, torch.zeros_like(log_prob)).clamp(-20.0, 20.0)
    return log_ratio, log_ratio.exp()


def _finish(loss_mat: Tensor, m: Tensor, normaliser: LossNormaliser, is_weights: Tensor | None) -> Tensor:
    if is_weights is not None:
        loss_mat = loss_mat * torch.where(m, is_weights, torch.zeros_like(is_weights))
    return aggregate(loss_mat, m, normaliser)


def sapo_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
              normaliser: LossNormaliser, tau_pos: float = 1.0, tau_neg: float = 1.05,
              is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Soft Adaptive Policy Optimization (SAPO; Gao et al. 2025, arXiv:2511.20347, eq. 5-6):
    a smooth sigmoid gate on the ratio instead of a hard clip.

        tau_t = tau_pos if A_t > 0 else tau_neg
        f_t   = (4 / tau_t) * sigmoid(tau_t * (r_t - 1))        value 2 / tau_t at r = 1
        l_t   = -f_t * A_t                                      gradient -4 s (1 - s) r A grad log pi

    At r = 1 the gradient is exactly the policy gradient (4 s (1 - s) = 1); it fades smoothly as
    r leaves 1, faster for larger tau. The paper (and verl's default) aggregates with
    seq-mean-token-mean. Defaults tau_pos = 1.0, tau_neg = 1.05 are verl's.
    Metrics: approx_kl, ratio_mean, ratio_max (as PPO)."""
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"sapo_loss: tau_pos and tau_neg must be > 0, got {tau_pos!r}, {tau_neg!r}")
    m = response_mask.bool()
    log_ratio, ratio = _ratio(log_prob, old_log_prob, m)
    adv = torch.where(m, advantages, torch.zeros_like(advantages))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return _finish(-gate * adv, m, normaliser, is_weights), _ratio_metrics(ratio, log_ratio, m)


def cispo_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
               normaliser: LossNormaliser, clip_low: float = 0.2, clip_high: float = 0.2,
               is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped IS-weight Policy Optimization (CISPO; MiniMax 2025, arXiv:2506.13585, eq. 4-5),
    as verl's `cispo`: the importance weight is clipped and detached, and every token keeps its
    policy gradient (PPO's clip zeroes the gradient of clipped tokens instead).

        w_t = sg[clip(r_t, 1 - clip_low, 1 + clip_high)]
        l_t = -w_t * A_t * log_prob_t                           gradient -w_t A_t grad log pi

    Metrics: clip_frac_upper / clip_frac_lower = share of valid tokens whose weight was clipped
    (r > 1 + clip_high / r < 1 - clip_low, whatever the sign of A); approx_kl, ratio_mean,
    ratio_max."""
    m = response_mask.bool()
    zero = torch.zeros_like(log_prob)
    log_ratio, ratio = _ratio(log_prob, old_log_prob, m)
    weight = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = -weight * torch.where(m, advantages, zero) * torch.where(m, log_prob, zero)
    metrics = {"clip_frac_upper": _masked_mean(ratio > 1.0 + clip_high, m),
               "clip_frac_lower": _masked_mean(ratio < 1.0 - clip_low, m),
               **_ratio_metrics(ratio, log_ratio, m)}
    return _finish(loss_mat, m, normaliser, is_weights), metrics


def gmpo_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
              normaliser: LossNormaliser, clip_low: float = 0.4, clip_high: float = 0.4,
              is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Geometric-Mean Policy Optimization (GMPO; Zhao et al. 2025, arXiv:2507.20673, eq. 4), as
    verl's `geo_mean`: the sequence's ratio is the geometric mean of its token ratios, each
    clipped in log space on the side the advantage's sign makes binding.

        x_t   = log_prob_t - old_t
        c_t   = sgn(A) * min(sgn(A) x_t, sgn(A) clip(x_t, -clip_low, clip_high))
        rho_i = exp( (1/|y_i|) sum_t c_t )                    (log clamped to [-20, 20])
        A_i   = (1/|y_i|) sum_t A_t                           (sequence advantage)
        l_i   = -A_i * rho_i,  put on every valid token of row i, then aggregated

    clip_low / clip_high are bounds on the LOG-ratio here (the paper's (e^-0.4, e^0.4) is
    0.4 / 0.4). With loss_agg=seq-mean-token-mean the aggregate is mean_i l_i, exactly verl's
    (which ignores loss_agg_mode); other modes weight sequences by length. is_weights multiply
    the per-token copies. Metrics: clip_frac_upper (A > 0 and x_t clipped), clip_frac_lower
    (A < 0 and x_t clipped), approx_kl, ratio_mean, ratio_max (of the token ratios)."""
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"gmpo_loss: clip bounds must be >= 0, got {clip_low!r}, {clip_high!r}")
    m = response_mask.bool()
    zero = torch.zeros_like(log_prob)
    x = torch.where(m, log_prob - old_log_prob, zero)
    adv = torch.where(m, advantages, zero)
    sign = torch.sign(adv)
    x_c = x.clamp(-clip_low, clip_high)
    c = sign * torch.minimum(sign * x, sign * x_c)
    lengths = m.sum(-1).clamp(min=1)
    seq_ratio = (c.sum(-1) / lengths).clamp(-20.0, 20.0).exp()
    seq_adv = adv.sum(-1) / lengths
    loss_mat = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(x)
    clipped = x != x_c
    log_ratio = x.clamp(-20.0, 20.0)
    metrics = {"clip_frac_upper": _masked_mean(clipped & (adv > 0) & m, m),
               "clip_frac_lower": _masked_mean(clipped & (adv < 0) & m, m),
               **_ratio_metrics(log_ratio.exp(), log_ratio, m)}
    return _finish(loss_mat, m, normaliser, is_weights), metrics


def _covariance(advantages: Tensor, log_prob: Tensor, m: Tensor) -> Tensor:
    """(A_t - mean A)(log_prob_t - mean log_prob), means over this micro-batch's valid tokens;
    detached (it selects tokens, it is never differentiated). -inf at padding."""
    a, lp = advantages.detach().float(), log_prob.detach().float()
    count = m.sum().clamp(min=1)
    mean_a = torch.where(m, a, torch.zeros_like(a)).sum() / count
    mean_lp = torch.where(m, lp, torch.zeros_like(lp)).sum() / count
    cov = torch.where(m, (a - mean_a) * (lp - mean_lp), torch.zeros_like(a))
    return torch.where(m, cov, torch.full_like(cov, -torch.inf))


def clip_cov_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                  normaliser: LossNormaliser, clip_low: float = 0.2, clip_high: float = 0.2,
                  cov_ratio: float = 2e-4, cov_lb: float = 1.0, cov_ub: float = 5.0,
                  generator: torch.Generator | None = None,
                  is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
    arXiv:2505.22617, sec. 5), as verl's `clip_cov`: PPO's clipped loss, with the gradient cut
    from a few random tokens whose covariance between advantage and log-prob is high (these
    drive the entropy collapse).

        l_t     = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        cov_t   = (A_t - mean A)(log_prob_t - mean log_prob)   means over this micro-batch
        cand    = valid, not clipped by PPO, cov_lb < cov_t < cov_ub
        k       = max(1, floor(cov_ratio * #valid tokens))
        l_t     = 0 on min(k, |cand|) tokens of cand drawn uniformly (`generator`)

    Metrics: clip_frac_upper / lower / dual (as PPO), cov_clip_frac (share of valid tokens cut),
    approx_kl, ratio_mean, ratio_max."""
    if not cov_ratio > 0:
        raise ValueError(f"clip_cov_loss: cov_ratio must be > 0, got {cov_ratio!r}")
    m = response_mask.bool()
    log_ratio, ratio = _ratio(log_prob, old_log_prob, m)
    adv = torch.where(m, advantages, torch.zeros_like(advantages))
    loss_mat, metrics = _clipped_surrogate(ratio, adv, m, clip_low, clip_high, None)
    by_clip = (-adv * ratio.clamp(1 - clip_low, 1 + clip_high)) > (-adv * ratio)
    cov = _covariance(adv, log_prob, m)
    cand = (m & ~by_clip & (cov > cov_lb) & (cov < cov_ub)).flatten().nonzero().squeeze(-1)
    k = max(1, int(cov_ratio * int(m.sum())))
    cut = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if cand.numel():
        order = torch.randperm(cand.numel(), generator=generator, device="cpu").to(cand.device)
        cut[cand[order[:k]]] = True
    cut = cut.view_as(m)
    loss_mat = torch.where(cut, torch.zeros_like(loss_mat), loss_mat)
    metrics["cov_clip_frac"] = _masked_mean(cut, m)
    metrics.update(_ratio_metrics(ratio, log_ratio, m))
    return _finish(loss_mat, m, normaliser, is_weights), metrics


def kl_cov_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                normaliser: LossNormaliser, cov_ratio: float = 2e-4, kl_coef: float = 1.0,
                is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, sec. 5), as verl's `kl_cov`: the unclipped
    surrogate, with a KL-like penalty |log r| on the tokens of highest covariance.

        l_t   = -A_t r_t
        cov_t = (A_t - mean A)(log_prob_t - mean log_prob)    means over this micro-batch
        top   = the k = max(1, floor(cov_ratio * #valid tokens)) valid tokens of largest cov_t
        l_t  += kl_coef * |log_prob_t - old_t|   on top

    Metrics: kl_cov_frac (share of valid tokens penalised), approx_kl, ratio_mean, ratio_max."""
    if not cov_ratio > 0:
        raise ValueError(f"kl_cov_loss: cov_ratio must be > 0, got {cov_ratio!r}")
    m = response_mask.bool()
    log_ratio, ratio = _ratio(log_prob, old_log_prob, m)
    adv = torch.where(m, advantages, torch.zeros_like(advantages))
    loss_mat = -adv * ratio
    num_valid = int(m.sum())
    top = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if num_valid:
        k = max(1, int(num_valid * cov_ratio))
        top[torch.topk(_covariance(adv, log_prob, m).flatten(), k).indices] = True
    top = top.view_as(m)
    loss_mat = torch.where(top, loss_mat + kl_coef * log_ratio.abs(), loss_mat)
    metrics = {"kl_cov_frac": _masked_mean(top, m), **_ratio_metrics(ratio, log_ratio, m)}
    return _finish(loss_mat, m, normaliser, is_weights), metrics


POLICY_LOSSES = {"clip": ppo_clip_loss, "gspo": gspo_loss, "pg": _pg_loss_uniform, "sapo": sapo_loss,
                 "cispo": cispo_loss, "gmpo": gmpo_loss, "clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}
"""actor.loss: name -> fn(log_prob, old_log_prob, advantages, response_mask, normaliser, **kwargs)
returning (loss, metrics). kwargs: clip: clip_low, clip_high, dual_clip; gspo, cispo, gmpo:
clip_low, clip_high; sapo: tau_pos, tau_neg; clip_cov: clip_low, clip_high, cov_ratio, cov_lb,
cov_ub, generator; kl_cov: cov_ratio, kl_coef; every one: is_weights."""
