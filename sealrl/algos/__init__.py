"""sealrl.algos: pure tensor functions of the algorithm layer (imports torch only).

advantages  GAE, GRPO / Dr.GRPO, RLOO, REINFORCE++ (+baseline), whitening
kl          KL estimators, KL-shaped token rewards, KL coefficient controllers
losses      loss aggregation (global normaliser), PPO / GSPO / PG policy losses, value loss, entropy
baselines   ReMax, OPO, GPG, pass@k, optimal token baseline (more critic-free estimators)
surrogates  SAPO, CISPO, GMPO, Clip-Cov, KL-Cov policy losses; POLICY_LOSSES, the table of all
correction  rollout-vs-trainer mismatch: truncated IS weights, rejection masks, metrics
"""
from sealrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)
from sealrl.algos.baselines import (
    gpg_advantages,
    opo_advantages,
    optimal_token_baseline_advantages,
    passk_advantages,
    remax_advantages,
    sum_pi_squared_from_logits,
)
from sealrl.algos.correction import (
    CORRECTIONS,
    correction_metrics,
    importance_weights,
    mismatch_metrics,
    rejection_mask,
)
from sealrl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    shaped_token_rewards,
)
from sealrl.algos.losses import (
    AGG_MODES,
    LossNormaliser,
    aggregate,
    entropy_from_logits,
    gspo_loss,
    make_normaliser,
    policy_gradient_loss,
    policy_ratio,
    ppo_clip_loss,
    ratio_stats,
    value_loss,
)
from sealrl.algos.surrogates import (
    POLICY_LOSSES,
    cispo_loss,
    clip_cov_loss,
    gmpo_loss,
    kl_cov_loss,
    sapo_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "CORRECTIONS", "broadcast_to_tokens", "gae", "grpo_advantages", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages", "rloo_advantages", "whiten",
    "correction_metrics", "importance_weights", "mismatch_metrics", "rejection_mask",
    "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "kl_penalty",
    "shaped_token_rewards",
    "AGG_MODES", "POLICY_LOSSES", "LossNormaliser", "aggregate", "entropy_from_logits",
    "gspo_loss", "make_normaliser", "policy_gradient_loss", "policy_ratio", "ppo_clip_loss", "ratio_stats",
    "value_loss",
    "gpg_advantages", "opo_advantages", "optimal_token_baseline_advantages", "passk_advantages",
    "remax_advantages", "sum_pi_squared_from_logits",
    "cispo_loss", "clip_cov_loss", "gmpo_loss", "kl_cov_loss", "sapo_loss",
]
