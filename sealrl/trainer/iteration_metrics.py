"""Per-iteration metrics computed by the driver from rollout samples, reward records, the
sealed batch and stage times. Every key is defined in docs/metrics.md."""
from __future__ import annotations

import torch

from sealrl import algos
from sealrl.experience import ExperienceBatch, RewardStatus


def rollout_metrics(groups, records, generate_s: float) -> dict[str, float]:
    """Rollout and reward facts over the samples of complete groups."""
    samples = [s for ss in groups.values() for s in ss]
    if not samples:
        return {}
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
    recs = [records[s.sample_id] for s in samples]
    ok = [r for r in recs if r.ok]
    reasons = [s.stop_reason.value for s in samples]
    response_tokens = float(lengths.sum())
    out = {
        "rollout/num_samples": float(len(samples)),
        "rollout/prompt_tokens": float(sum(len(ss[0].prompt_ids) for ss in groups.values())),
        "rollout/response_tokens": response_tokens,
        "rollout/tokens_per_s": response_tokens / generate_s if generate_s > 0 else 0.0,
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/response_len_p50": float(lengths.quantile(0.5)),
        "rollout/response_len_p90": float(lengths.quantile(0.9)),
        "rollout/response_len_max": float(lengths.max()),
        "reward/mean": sum(r.total for r in ok) / max(1, len(ok)),
        "reward/accuracy": sum(r.total > 0 for r in ok) / len(samples),
        "reward/status_error": float(sum(r.status is RewardStatus.ERROR for r in recs)),
        "reward/status_timeout": float(sum(r.status is RewardStatus.TIMEOUT for r in recs)),
    }
    for reason in ("eos", "stop", "length", "error"):
        out[f"rollout/stop_{reason}_frac"] = reasons.count(reason) / len(samples)
    components: dict[str, list[float]] = {}
    for r in ok:
        for name, value in r.components.items():
            components.setdefault(name, []).append(value)
    for name, values in components.items():
        t = torch.tensor(values, dtype=torch.float64)
        out[f"reward/component/{name}_mean"] = float(t.mean())
        out[f"reward/component/{name}_std"] = float(t.std()) if len(values) > 1 else 0.0
    return out


def batch_metrics(batch: ExperienceBatch, consumed_step: int, sampled_version_step: int) -> dict[str, float]:
    """Log-prob consistency, trained tokens and experience age of the consumed batch."""
    mask = batch.get("response_mask")
    old = batch.get("old_log_probs")
    out = {f"logprob/old_vs_rollout_{k}": float(v)
           for k, v in algos.mismatch_metrics(old, batch.get("rollout_log_probs"), mask).items()}
    if batch.has("ref_log_probs"):
        ref = batch.get("ref_log_probs")
        out.update({f"logprob/old_vs_ref_{k}": float(v) for k, v in algos.mismatch_metrics(ref, old, mask).items()
                    if k in ("k1", "k3", "log_prob_abs_diff_max")})
        k3 = algos.kl_penalty(old, ref, "k3")
        out["kl/ref_kl"] = float((k3 * mask).sum() / mask.sum().clamp(min=1))
    out["e2e/trained_tokens"] = float(mask.sum())
    out["e2e/accepted_groups"] = float(len(set(batch.group_ids)))
    # Synchronous training: experience sampled by version step s is consumed by the optimizer
    # steps s+1 .. consumed_step; the age is how many steps used it (0 lag at the first).
    out["update/experience_age_steps"] = float(consumed_step - sampled_version_step)
    return out


def stage_shares(stage_seconds: dict[str, float], iteration_s: float) -> dict[str, float]:
    """Share of the iteration's wall time per stage (the synchronous loop is the critical path)."""
    if iteration_s <= 0:
        return {}
    return {f"time/share_{name}": seconds / iteration_s for name, seconds in stage_seconds.items()}
