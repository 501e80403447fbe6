"""Advantage estimators: GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ (+baseline), whitening.

Conventions shared by every function here:

- A batch is B rows of right-padded response tokens, T wide. `response_mask` (B, T) is 1 on
  action tokens only. Positions with mask 0 never contribute to anything and come out as 0,
  whatever garbage sits there (selection is done with `torch.where`, never by multiplying a
  possibly huge number by 0).
- A mask may also have holes (e.g. tool-output tokens inside a multi-turn response). Recurrences
  then skip the hole: the next state of an action is the next *action* token, and gamma is
  applied once per action, not once per position. Rewards sitting on masked positions are ignored.
- Outputs are not detached: pass detached rewards / values (facts of the sealed experience).
- Sample identity is the integer `group_index`, never a position: groups may be interleaved.
"""
from __future__ import annotations

import torch
from torch import Tensor

# algorithm.name: the advantage estimator (ppo = GAE with a critic); trainer/derive.py applies it
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo",
                        "remax", "opo", "gpg", "grpo_passk", "optimal_token_baseline")   # these five: baselines.py


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Copy one advantage per sequence onto its valid tokens.

    out[b, t] = adv[b] if mask[b, t] else 0.    adv (B,), mask (B, T) -> (B, T)
    """
    return torch.where(mask.bool(), adv.unsqueeze(-1), torch.zeros_like(adv).unsqueeze(-1))


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x over its valid entries (all of the batch at once).

        mu  = sum(m x) / sum(m)
        var = sum(m (x - mu)^2) / sum(m)          # population (biased) variance
        out = (x - mu) / sqrt(var + eps)          # shift_mean=True
        out = (x - mu) / sqrt(var + eps) + mu     # shift_mean=False: rescale, keep the mean

    x, mask (B, T) -> (B, T); 0 at padding. No valid entry -> all zeros. A single valid entry
    (var = 0) gives 0 with shift_mean, and x itself without.
    The biased variance is deliberate: batches hold thousands of tokens, and it keeps a
    one-token batch finite.
    """
    m = mask.bool()
    zero = torch.zeros_like(x)
    count = m.sum().clamp(min=1)
    mu = torch.where(m, x, zero).sum() / count
    centred = torch.where(m, x - mu, zero)
    var = centred.pow(2).sum() / count
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mu
    return torch.where(m, out, zero)


def _last_token_mask(mask: Tensor) -> Tensor:
    """(B, T) bool: True on the last valid token of each row (no True in an all-masked row)."""
    m = mask.bool()
    after_or_at = m.flip(-1).long().cumsum(-1).flip(-1)  # number of valid tokens at t or later
    return m & (after_or_at == 1)


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G_{next valid t}; 0 after the last valid token.

    rewards, mask (B, T) -> (B, T), 0 at padding. Holes in the mask are skipped.
    """
    m = mask.bool()
    zero = torch.zeros_like(rewards[:, 0])
    carry = zero  # G of the next valid token, (B,)
    out = []
    for t in reversed(range(rewards.shape[1])):
        g = torch.where(m[:, t], rewards[:, t], zero) + gamma * carry
        carry = torch.where(m[:, t], g, carry)
        out.append(torch.where(m[:, t], g, zero))
    return torch.stack(out[::-1], dim=1)


def gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, terminated: Tensor,
        last_values: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 11-16).

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = delta_t + gamma * lam * A_{t+1}        (A after the last valid token = 0)
        R_t     = A_t + V(s_t)                           (the critic's regression target)

    token_rewards, values, response_mask (B, T); terminated (B,) bool; last_values (B,).
    values[:, t] = V(s_t), the state before action t. For the last valid token of a row,
    V(s_{t+1}) is 0 if the row `terminated` (EOS / stop / task end) and `last_values` if it was
    truncated (length, deadline): a cut response is not the end of the episode, so it bootstraps.
    Returns (advantages, returns), both (B, T), 0 at padding.

    Implementation: one backward pass over T carrying (V of the next action, A of the next
    action) per row; masked positions leave the carry untouched, so holes are skipped.
    """
    m = response_mask.bool()
    zero = torch.zeros_like(last_values)
    next_value = torch.where(terminated.bool(), zero, last_values)  # (B,)
    next_adv = zero  # (B,)
    advs = []
    for t in reversed(range(values.shape[1])):
        valid = m[:, t]
        v_t = torch.where(valid, values[:, t], zero)  # garbage at padding never enters delta
        r_t = torch.where(valid, token_rewards[:, t], zero)
        a_t = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        next_value = torch.where(valid, v_t, next_value)
        next_adv = torch.where(valid, a_t, next_adv)
        advs.append(torch.where(valid, a_t, zero))
    advantages = torch.stack(advs[::-1], dim=1)  # (B, T)
    returns = torch.where(m, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def _group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sample statistics of the sample's own group, with scatter ops (no loop over groups).

    scores (B,) float, group_index (B,) long (any ids, any order) ->
    (group sum (B,), group count (B,) float, group unbiased variance (B,), zero_var (B,) bool).
    zero_var: the group has one sample or all its scores are exactly equal (max == min, which
    is exact, unlike a variance computed in floating point). Its variance is reported as 0.
    """
    ids, inv = torch.unique(group_index, return_inverse=True)  # compact ids 0..G-1, (B,)
    num_groups = ids.numel()
    zeros_g = scores.new_zeros(num_groups)
    g_sum = zeros_g.index_add(0, inv, scores)
    g_count = zeros_g.index_add(0, inv, torch.ones_like(scores))
    g_max = zeros_g.scatter_reduce(0, inv, scores, "amax", include_self=False)
    g_min = zeros_g.scatter_reduce(0, inv, scores, "amin", include_self=False)
    g_zero_var = (g_count < 2) | (g_max == g_min)
    g_mean = g_sum / g_count.clamp(min=1)
    sq_dev = (scores - g_mean[inv]).pow(2)
    g_var = zeros_g.index_add(0, inv, sq_dev) / (g_count - 1).clamp(min=1)
    g_var = torch.where(g_zero_var, zeros_g, g_var)
    return g_sum[inv], g_count[inv], g_var[inv], g_zero_var[inv]


def grpo_advantages(scores: Tensor, group_index: Tensor, eps: float = 1e-6,
                    norm_by_std: bool = True) -> tuple[Tensor, Tensor]:
    """Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300, sec. 4.1.2).

        adv_i = (r_i - mean_g) / (std_g + eps)      norm_by_std=True   (GRPO)
        adv_i =  r_i - mean_g                       norm_by_std=False  (Dr.GRPO, Liu et al. 2025,
                                                                        arXiv:2503.20783)
    std_g is the *unbiased* (n - 1) group standard deviation, as `torch.std` and most
    implementations compute it (the paper only writes std(r)).

    scores (B,), group_index (B,) long -> (adv (B,), zero_var (B,) bool).
    zero_var marks samples of single-sample or zero-variance groups; their advantage is exactly
    0 (not a 1e-8 / (1e-8 + eps) rounding artefact), and no gradient path through them is NaN.
    Multiply by the response mask with `broadcast_to_tokens` to get (B, T).
    """
    scores = scores if scores.is_floating_point() else scores.float()
    g_sum, g_count, g_var, zero_var = _group_stats(scores, group_index)
    centred = scores - g_sum / g_count
    if norm_by_std:
        # sqrt of 1 instead of 0 where the result is discarded anyway: keeps the gradient finite
        std = torch.where(zero_var, torch.ones_like(g_var), g_var).sqrt()
        centred = centred / (std + eps)
    adv = torch.where(zero_var, torch.zeros_like(centred), centred)
    return adv, zero_var


def rloo_advantages(scores: Tensor, group_index: Tensor) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740, eq. 6; Kool et al. 2019).

        adv_i = r_i - (sum_g - r_i) / (n_g - 1)        (= n_g / (n_g - 1) * (r_i - mean_g))

    scores (B,), group_index (B,) long -> (B,). A single-sample group has no "others": adv = 0.
    """
    scores = scores if scores.is_floating_point() else scores.float()
    g_sum, g_count, _, _ = _group_stats(scores, group_index)
    single = g_count < 2
    others_mean = (g_sum - scores) / torch.where(single, torch.ones_like(g_count), g_count - 1)
    return torch.where(single, torch.zeros_like(scores), scores - others_mean)


def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor,
                            gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262, sec. 3): whitened discounted return-to-go.

        G_t   = sum_{s >= t, s valid} gamma^(#valid tokens between t and s) r_s
        adv_t = whiten(G, over all valid tokens of the whole batch)

    token_rewards, response_mask (B, T) -> (B, T), 0 at padding. token_rewards are usually the
    KL-shaped rewards of `shaped_token_rewards` (score on the last token, -beta * kl elsewhere).
    Call it on the whole global batch: the whitening statistics are batch statistics.
    """
    returns = _discounted_returns(token_rewards, response_mask, gamma)
    return whiten(returns, response_mask)


def reinforce_pp_baseline_advantages(scores: Tensor, group_index: Tensor, response_mask: Tensor,
                                     token_rewards: Tensor | None = None,
                                     gamma: float = 1.0) -> Tensor:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): group-mean baseline, then batch whitening.

        b_i   = r_i - mean_g(r)                          (per sample, the group's mean baseline)
        u_t   = b_i * [t is the last valid token] + k_t  (k = token_rewards, 0 if None)
        G_t   = discounted return-to-go of u (gamma)     (= b_i + sum_{s>=t} k_s when gamma = 1)
        adv_t = whiten(G, over all valid tokens of the whole batch)

    scores (B,), group_index (B,) long, response_mask (B, T), token_rewards (B, T) or None.
    KL in the reward enters through `token_rewards`, which must hold the KL part *only*
    (e.g. `-beta * kl` on valid tokens, no score): the score is baselined here, and a KL term
    should not be, since it is per token and not shared by the group. -> (B, T), 0 at padding.
    """
    scores = scores if scores.is_floating_point() else scores.float()
    g_sum, g_count, _, _ = _group_stats(scores, group_index)
    baselined = scores - g_sum / g_count  # (B,)
    last = _last_token_mask(response_mask)
    rewards = torch.where(last, baselined.unsqueeze(-1), torch.zeros_like(baselined).unsqueeze(-1))
    if token_rewards is not None:
        rewards = rewards + torch.where(response_mask.bool(), token_rewards,
                                        torch.zeros_like(token_rewards))
    return whiten(_discounted_returns(rewards, response_mask, gamma), response_mask)
