"""More critic-free advantage estimators, as verl users select them: ReMax, OPO, GPG, pass@k,
and the optimal token baseline. Same conventions as `sealrl.algos.advantages` (groups by the integer
`group_index`, never by position; padding comes out 0; a group of one sample has nobody to be
compared with and gets advantage 0, where verl uses a baseline of 0 and so the raw score).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sealrl.algos.advantages import _discounted_returns, _group_stats


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


def remax_advantages(token_rewards: Tensor, baseline_scores: Tensor, response_mask: Tensor) -> Tensor:
    """ReMax (Li et al. 2023, arXiv:2310.10505, Algorithm 1), as verl's `remax`: REINFORCE with
    the reward of the prompt's greedy response as the baseline.

        G_t = sum_{s >= t, s valid} r_s           return-to-go of the token rewards (gamma = 1)
        A_t = G_t - b_i                           b_i = reward of the greedy (argmax) response to
                                                  sample i's prompt, same policy version

    Not whitened. token_rewards, response_mask (B, T); baseline_scores (B,) -> (B, T), 0 at
    padding; holes in the mask are skipped by the return."""
    m = response_mask.bool()
    returns = _discounted_returns(token_rewards.float(), m, 1.0)
    return torch.where(m, returns - baseline_scores.float().unsqueeze(-1), torch.zeros_like(returns))


def opo_advantages(scores: Tensor, group_index: Tensor, lengths: Tensor) -> Tensor:
    """On-Policy RL with Optimal reward baseline (OPO; Hao et al. 2025, arXiv:2505.23585, eq. 6):
    the length-weighted mean of the group's scores, as verl's `opo` estimator computes it.

        b_g   = sum_{j in g} L_j r_j / sum_{j in g} L_j        (L = response length in tokens)
        adv_i = r_i - b_g                                      (0 for a group of one)

    scores (B,), group_index (B,) long, lengths (B,) -> (B,). A group whose responses are all
    empty (sum L = 0) falls back to the plain mean (every weight equal)."""
    scores, lengths = _float(scores), _float(lengths).to(scores.dtype)
    _, inv = torch.unique(group_index, return_inverse=True)
    zeros = scores.new_zeros(int(inv.max()) + 1 if inv.numel() else 0)
    count = zeros.index_add(0, inv, torch.ones_like(scores))[inv]
    weights = torch.where(zeros.index_add(0, inv, lengths)[inv] > 0, lengths, torch.ones_like(lengths))
    baseline = zeros.index_add(0, inv, weights * scores)[inv] / zeros.index_add(0, inv, weights)[inv]
    return torch.where(count < 2, torch.zeros_like(scores), scores - baseline)


def gpg_advantages(scores: Tensor, group_index: Tensor, f_norm: float = 1.0) -> Tensor:
    """Group Policy Gradient (GPG; Chu et al. 2025, arXiv:2504.02546), as verl's `gpg`
    estimator computes it: the group-mean baseline without the std, scaled up by the share of
    the batch that carries a reward.

        alpha = B / max(1, #{i : r_i != 0})          (over the whole batch)
        adv_i = alpha * (r_i - mean_g(r)) / f_norm   (0 for a group of one)

    scores (B,), group_index (B,) -> (B,). Pair it with the plain policy gradient loss
    (actor.loss=pg), as verl's `loss_mode: gpg` is."""
    if not f_norm > 0:
        raise ValueError(f"gpg_advantages: f_norm must be > 0, got {f_norm!r}")
    scores = _float(scores)
    g_sum, g_count, _, _ = _group_stats(scores, group_index)
    alpha = scores.numel() / max(1, int((scores != 0).sum()))
    adv = alpha * (scores - g_sum / g_count) / f_norm
    return torch.where(g_count < 2, torch.zeros_like(adv), adv)


def passk_advantages(scores: Tensor, group_index: Tensor, eps: float = 1e-6,
                     norm_by_std: bool = True) -> Tensor:
    """Pass@k advantage for GRPO-style groups, verl's `grpo_passk` formulation (after Tang et
    al. 2025, arXiv:2503.19595: the best of k is what pass@k rewards, so only the best
    response of each group is credited, by its margin over the runner-up).

        i*     = argmax_{i in g} r_i        (the first one, in batch order, on a tie)
        adv_i* = (r_(1) - r_(2)) / (std_g + eps)    r_(1) >= r_(2): the two largest scores
        adv_i  = 0 for every other member    (and for a group of one: verl refuses those)

    std_g is the unbiased group std (as GRPO); norm_by_std=False drops the division. With tied
    best scores the margin is 0, so the whole group gets 0. scores, group_index (B,) -> (B,)."""
    scores = _float(scores)
    _, inv = torch.unique(group_index, return_inverse=True)
    _, g_count, g_var, _ = _group_stats(scores, group_index)
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    zeros = scores.new_zeros(num_groups)
    best = zeros.scatter_reduce(0, inv, scores, "amax", include_self=False)
    pos = torch.arange(scores.numel(), device=scores.device)
    is_best = scores == best[inv]
    big = scores.numel()
    first = torch.full((num_groups,), big, dtype=torch.long, device=scores.device).scatter_reduce(
        0, inv, torch.where(is_best, pos, torch.full_like(pos, big)), "amin")
    winner = pos == first[inv]
    runner_up = zeros.scatter_reduce(0, inv, torch.where(winner, torch.full_like(scores, -torch.inf), scores),
                                     "amax", include_self=False)
    margin = best[inv] - runner_up[inv]
    if norm_by_std:
        margin = margin / (g_var.sqrt() + eps)
    keep = winner & (g_count >= 2)
    return torch.where(keep, margin, torch.zeros_like(scores))


def sum_pi_squared_from_logits(logits: Tensor) -> Tensor:
    """sum_v pi(v)^2 of softmax(logits) over the last axis: (..., V) -> (...)."""
    return torch.softmax(logits.float(), dim=-1).pow(2).sum(-1)


def optimal_token_baseline_advantages(token_rewards: Tensor, response_mask: Tensor, group_index: Tensor,
                                      old_log_probs: Tensor, sum_pi_squared: Tensor,
                                      is_weights: Tensor | None = None, handle_zero_tail: bool = True,
                                      eps: float = 1e-8) -> Tensor:
    """Optimal Token Baseline (OTB; Li et al. 2026, "The Optimal Token Baseline"), as verl's
    `optimal_token_baseline` estimator defines it: one baseline per group and per position t,
    weighting each trajectory by its accumulated gradient-norm proxy.

        G_t   = sum_{s >= t, s valid} r_s                     return-to-go (gamma = 1)
        w_t   = 1 - 2 pi_t + sum_v pi(v)^2                    ||grad log pi||^2 proxy of token t
                                                              (pi_t = exp(old_log_probs_t);
                                                              times is_weights_t^2 if given)
        W_t   = sum_{s <= t, s valid} w_s                     cumulative path variance
        B_t   = sum_{i in g} m_it G_it W_it / (sum_{i in g} m_it W_it + eps)
        A_t   = G_t - B_t                                     on valid tokens, 0 elsewhere

    handle_zero_tail: where only the group's single longest response is still running (beyond
    the second-longest length), B_t would be its own G_t and A_t ~ 0; the baseline is set to 0
    there instead (A_t = G_t), as verl does by default. Positions are aligned by index t (single
    turn). A group of one gets 0. token_rewards, response_mask, old_log_probs, sum_pi_squared,
    is_weights (B, T); group_index (B,) -> (B, T)."""
    m = response_mask.bool()
    zero = torch.zeros_like(token_rewards, dtype=torch.float32)
    returns = _discounted_returns(token_rewards.float(), m, 1.0)
    w = 1.0 - 2.0 * old_log_probs.float().exp() + sum_pi_squared.float()
    if is_weights is not None:
        w = w * is_weights.float().pow(2)
    W = torch.where(m, w, zero).cumsum(-1)
    _, inv = torch.unique(group_index, return_inverse=True)
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    mW = torch.where(m, W, zero)
    num = zero.new_zeros(num_groups, m.shape[1]).index_add(0, inv, mW * returns)
    den = zero.new_zeros(num_groups, m.shape[1]).index_add(0, inv, mW)
    baseline = (num / (den + eps))[inv]
    lengths = m.sum(-1)
    count = zero.new_zeros(num_groups).index_add(0, inv, torch.ones_like(lengths, dtype=torch.float32))[inv]
    if handle_zero_tail:
        # the second-longest length of each group: the largest length once one longest is removed
        longest = lengths.new_zeros(num_groups).scatter_reduce(0, inv, lengths, "amax", include_self=False)
        at_max = (lengths == longest[inv]).long()
        n_at_max = lengths.new_zeros(num_groups).index_add(0, inv, at_max)
        others = torch.where(lengths == longest[inv], torch.zeros_like(lengths), lengths)
        second = lengths.new_zeros(num_groups).scatter_reduce(0, inv, others, "amax", include_self=False)
        unique_longest = (at_max == 1) & (n_at_max[inv] == 1)
        pos = torch.arange(m.shape[1], device=m.device)
        tail = unique_longest[:, None] & (pos[None, :] >= second[inv][:, None])
        baseline = torch.where(tail, zero, baseline)
    adv = torch.where(m & (count >= 2)[:, None], returns - baseline, zero)
    return adv
