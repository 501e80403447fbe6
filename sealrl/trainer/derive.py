"""Derived tensors of a sealed batch (driver side): scores after the reward-error policy,
shaped token rewards, advantages, returns. A pure function of the sealed facts and the
algorithm hyper-parameters, so `recompute` can redo it offline without a new rollout."""
from __future__ import annotations

import torch

from sealrl import algos
from sealrl.config import AlgorithmConfig
from sealrl.experience import ExperienceBatch, Role


def group_index(group_ids: list[str]) -> torch.Tensor:
    """(B,) integer group id per sample, in order of first appearance (never by position)."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(g, len(ids)) for g in group_ids], dtype=torch.long)


def sequence_scores(batch: ExperienceBatch, algo: AlgorithmConfig, max_new_tokens: int) -> torch.Tensor:
    """(B,) training score: the ok reward total, or the explicit penalty for an errored
    record (only reachable with reward_error=penalty), plus the soft overlong penalty (DAPO) on
    the policy tokens (response_mask: an episode's observation tokens are not the policy's)."""
    return training_scores(batch.get("reward_records", producer=Role.REWARD),
                           batch.get("response_mask").sum(-1).tolist(), algo, max_new_tokens)


def training_scores(records, lengths: list[int], algo: AlgorithmConfig, max_new_tokens: int) -> torch.Tensor:
    """`sequence_scores` from reward records and policy-token counts (also dynamic sampling's filter)."""
    scores = torch.tensor([r.total if r.ok else algo.reward_error_penalty for r in records],
                          dtype=torch.float32)
    if algo.overlong == "soft":
        lengths = torch.tensor(lengths, dtype=torch.float32)
        start = max_new_tokens - algo.overlong_buffer
        over = ((lengths - start) / max(1, algo.overlong_buffer)).clamp(min=0.0, max=1.0)
        scores = scores - algo.overlong_penalty * over
    return scores


VERL_ESTIMATORS = ("remax", "opo", "gpg", "grpo_passk", "optimal_token_baseline")


def verl_estimator(name: str, batch: ExperienceBatch, seq_scores: torch.Tensor, gidx: torch.Tensor,
                   token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) advantages of the estimators of sealrl.algos.baselines. The optimal token baseline
    reads the old policy's per-token sum of squared probabilities (prepare.py records it), ReMax
    the greedy baseline of each sample (remax.py records it)."""
    if name == "remax":
        return algos.remax_advantages(token_rewards, batch.get("baseline_scores"), mask)
    if name == "optimal_token_baseline":
        return algos.optimal_token_baseline_advantages(token_rewards, mask, gidx, batch.get("old_log_probs"),
                                                       batch.get("sum_pi_squared"))
    if name == "opo":
        seq = algos.opo_advantages(seq_scores, gidx, mask.sum(-1))
    elif name == "gpg":
        seq = algos.gpg_advantages(seq_scores, gidx)
    else:
        seq = algos.passk_advantages(seq_scores, gidx)
    return algos.broadcast_to_tokens(seq, mask)


def derive(batch: ExperienceBatch, algo: AlgorithmConfig, beta: float, max_new_tokens: int,
           version: str) -> dict[str, float]:
    """Write scores, token_rewards, advantages (and returns, PPO) into the batch; return metrics.

    KL in the reward uses the sampling policy's log-probs (old) against the reference. For
    outcome-level algorithms (GRPO, RLOO, REINFORCE++-baseline) the KL enters as
    score - beta * sum_t kl_t, since their advantage is one number per sequence."""
    mask = batch.get("response_mask")
    scores = sequence_scores(batch, algo, max_new_tokens)
    kl = torch.zeros_like(batch.get("rollout_log_probs"))
    if beta > 0 and algo.kl_in == "reward":
        kl = algos.kl_penalty(batch.get("old_log_probs"), batch.get("ref_log_probs"),
                              algo.kl_estimator.rstrip("+")).masked_fill(~mask, 0.0)
    token_rewards = algos.shaped_token_rewards(scores, kl, mask, beta if algo.kl_in == "reward" else 0.0)
    seq_scores = scores - (beta * (kl * mask).sum(-1) if algo.kl_in == "reward" else 0.0)
    if batch.has("step_rewards"):   # multi-turn: a step reward sits on the last token of its turn
        step = batch.get("step_rewards", producer=Role.ROLLOUT)
        token_rewards, seq_scores = token_rewards + step, seq_scores + step.sum(-1)
    gidx = group_index(batch.group_ids)
    zero_var = torch.zeros(len(batch), dtype=torch.bool)
    returns = None
    name = algo.name
    if name == "ppo":
        terminated = torch.tensor([s.stop_reason.terminated for s in batch.samples])
        adv, returns = algos.gae(token_rewards, batch.get("values"), mask, terminated,
                                 batch.get("last_values"), algo.gamma, algo.lam)
    elif name in ("grpo", "dr_grpo"):
        a, zero_var = algos.grpo_advantages(seq_scores, gidx, norm_by_std=(name == "grpo"))
        adv = algos.broadcast_to_tokens(a, mask)
    elif name == "rloo":
        adv = algos.broadcast_to_tokens(algos.rloo_advantages(seq_scores, gidx), mask)
    elif name == "reinforce_pp":
        adv = algos.reinforce_pp_advantages(token_rewards, mask, gamma=algo.gamma)
    elif name in VERL_ESTIMATORS:
        adv = verl_estimator(name, batch, seq_scores, gidx, token_rewards, mask)
    else:  # reinforce_pp_baseline
        # KL (and multi-turn step rewards) enter as per-token rewards; only the score is baselined.
        per_token = -beta * kl
        if batch.has("step_rewards"):
            per_token = per_token + batch.get("step_rewards", producer=Role.ROLLOUT)
        adv = algos.reinforce_pp_baseline_advantages(scores, gidx, mask, token_rewards=per_token, gamma=algo.gamma)
    if algo.whiten_advantages:
        adv = algos.whiten(adv, mask)
    adv = adv.masked_fill(~mask, 0.0).float()
    batch.put("scores", scores, Role.DRIVER, version)
    batch.put("token_rewards", token_rewards.masked_fill(~mask, 0.0).float(), Role.DRIVER, version)
    batch.put("advantages", adv, Role.DRIVER, version)
    batch.put("zero_variance", zero_var.bool(), Role.DRIVER, version)
    if returns is not None:
        batch.put("returns", returns.masked_fill(~mask, 0.0).float(), Role.DRIVER, version)
    valid = mask.sum().clamp(min=1)
    return {
        "reward/score_mean": float(scores.mean()) if len(scores) else 0.0,
        "reward/score_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "adv/mean": float((adv * mask).sum() / valid),
        "adv/std": float(((adv - (adv * mask).sum() / valid) ** 2 * mask).sum().div(valid).sqrt()),
        "adv/zero_variance_frac": float(zero_var.float().mean()) if len(zero_var) else 0.0,
        "kl/reward_kl": float((kl * mask).sum() / valid),
    }
