"""Per-iteration metrics computed by the driver from rollout samples, reward records, the
ledger's rows, the sealed batch and stage times. Every key is defined in docs/metrics.md."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from sealrl import algos
from sealrl.experience import ExperienceBatch, RewardStatus, Role
from sealrl.obs.timeline import stage_shares
from sealrl.roles.common import structure


def is_wall_clock(key: str) -> bool:
    """Metrics measured with a clock or the allocator (stage times, latencies, queue times,
    throughputs, FLOP rates, peak memory): they differ between any two runs; every other metric is a
    function of the seeds and data, and bitwise the same in a resumed or repeated run."""
    last = key.rsplit("/", 1)[-1]
    return key.startswith(("time/", "memory/", "perf/")) or last.endswith(("_s", "_per_s")) or "_s_" in last


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
    # finish_s counts from the generate stage start (collect.generate shifts each call's).
    group_done = torch.tensor([max(s.finish_s for s in ss) for ss in groups.values()], dtype=torch.float64)
    out["rollout/first_completion_s"] = min(s.finish_s for s in samples)
    out["rollout/last_completion_s"] = float(group_done.max())
    out["rollout/group_completion_s_mean"] = float(group_done.mean())
    out["rollout/group_completion_s_min"] = float(group_done.min())
    components: dict[str, list[float]] = {}
    for r in ok:
        for name, value in r.components.items():
            components.setdefault(name, []).append(value)
    for name, values in components.items():
        t = torch.tensor(values, dtype=torch.float64)
        out[f"reward/component/{name}_mean"] = float(t.mean())
        out[f"reward/component/{name}_std"] = float(t.std()) if len(values) > 1 else 0.0
    return out


def stage_io_metrics(stage_spans: Sequence[tuple[str, float, float]], groups, recoveries: list[float]
                     ) -> dict[str, float]:
    """The reward stage's response tokens/s and queue time (the gap after the generate stage),
    and the rollout replicas replaced in the iteration with the seconds their recovery took."""
    spans = {name: (start, end) for name, start, end in stage_spans}
    out = {"rollout/replica_replacements": float(len(recoveries)), "rollout/replica_recovery_s": sum(recoveries)}
    if "reward" in spans and "generate" in spans:
        start, end = spans["reward"]
        tokens = sum(len(s.response_ids) for ss in groups.values() for s in ss)
        out["reward/queue_s"] = start - spans["generate"][1]
        out["reward/tokens_per_s"] = tokens / (end - start) if end > start else 0.0
    return out


def ref_kl(batch: ExperienceBatch) -> float:
    """`kl/ref_kl`, what the adaptive KL controller steps on: mean k3 of old vs reference
    log-probs over action tokens (0 without a reference)."""
    if not batch.has("ref_log_probs"):
        return 0.0
    mask = batch.get("response_mask")
    k3 = algos.kl_penalty(batch.get("old_log_probs"), batch.get("ref_log_probs"), "k3")
    return float((k3 * mask).sum() / mask.sum().clamp(min=1))


def batch_metrics(batch: ExperienceBatch, loss_mask: torch.Tensor, consumed_step: int,
                  sampled_version_step: int) -> dict[str, float]:
    """Log-prob consistency, trained tokens and experience age of the consumed batch.
    loss_mask: the actor's (roles.actor.loss_mask), the tokens that took part in the loss."""
    mask = batch.get("response_mask")
    old = batch.get("old_log_probs")
    out = {}
    if batch.provenance("old_log_probs")[0] is not Role.ROLLOUT:
        # bypass (old = the rollout's own log-probs): nothing measured, so nothing reported
        out.update({f"logprob/old_vs_rollout_{k}": float(v)
                    for k, v in algos.mismatch_metrics(old, batch.get("rollout_log_probs"), mask).items()})
    if batch.has("ref_log_probs"):
        ref = batch.get("ref_log_probs")
        out.update({f"logprob/old_vs_ref_{k}": float(v) for k, v in algos.mismatch_metrics(ref, old, mask).items()
                    if k in ("k1", "k3", "log_prob_abs_diff_max")})
        out["kl/ref_kl"] = ref_kl(batch)
    out["e2e/trained_tokens"] = float(loss_mask.sum())
    out["e2e/accepted_groups"] = float(len(set(batch.group_ids)))
    # Synchronous training: experience sampled by version step s is consumed by the optimizer
    # steps s+1 .. consumed_step; the age is how many steps used it (0 lag at the first).
    out["update/experience_age_steps"] = float(consumed_step - sampled_version_step)
    return out


def version_metrics(ledger_rows: list[dict], n: int, trained_group_ids: Sequence[str],
                    version_step: int) -> dict[str, float]:
    """Samples of the iteration's policy version by outcome, and the effective group size.

    ledger_rows: IterationLedger.rows(), one per group the iteration asked for;
    trained_group_ids: the group id of each sample of the sealed batch (the samples that reach
    the loss). The synchronous driver samples an iteration with one version, so one set of
    counts per iteration is the per-version count, stamped with `version_step`."""
    per_group = Counter(trained_group_ids)
    sizes = [per_group.get(row["group_id"], 0) for row in ledger_rows]
    if not sizes:
        return {}
    return {
        "rollout/policy_version_step": float(version_step),
        "rollout/samples_ok": float(len(trained_group_ids)),
        "rollout/samples_retried": float(sum(row["regenerated"] for row in ledger_rows)),
        "rollout/samples_dropped": float(n * sum(row["status"] == "dropped" for row in ledger_rows)),
        "groups/effective_size_mean": sum(sizes) / len(sizes),
        "groups/effective_size_min": float(min(sizes)),
    }


def preparation_metrics(stage_spans: Sequence[tuple[str, float, float]], batch: ExperienceBatch,
                        forward_stages: Iterable[str]) -> dict[str, float]:
    """Tokens/s and queue time of each preparation stage that ran a forward pass over `batch`.

    stage_spans: StageTimer.stage_spans, (stage, start, end) in seconds. A role's forward
    processes every sample's prompt and response tokens (padding excluded). A stage's queue time
    is the gap from the end of the latest stage that ended before it started to its start:
    its input was complete then, and in the synchronous driver the gap is the driver's own
    work (e.g. building the batch) that the role waited on."""
    forward_stages = set(forward_stages)
    num_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
    out = {}
    for i, (name, start, end) in enumerate(stage_spans):
        if name not in forward_stages:
            continue
        before = [e for _, _, e in stage_spans[:i] if e <= start]
        if before:
            out[f"prep/{name}_queue_s"] = start - max(before)
        if end > start:
            out[f"prep/{name}_tokens_per_s"] = num_tokens / (end - start)
    return out


def share_metrics(metrics_row: dict) -> dict[str, float]:
    """`time/share_<stage>` and `time/share_other` of a row with `time/<stage>_s` and
    `time/iteration_s`, by the timeline's one definition (sealrl.obs.timeline.stage_shares),
    which the report uses too."""
    return {f"time/share_{stage}": share for stage, share in stage_shares(metrics_row).items()}


def perf_metrics(run, batch: ExperienceBatch, stage_seconds: dict[str, float], reused: bool,
                 stepped_there: bool = False) -> dict[str, float]:
    """perf/<pass>_tflops and _mfu of the iteration's passes (obs/flops.py): generate (prefill of
    each prompt once, every response token), the teacher-forced reference, old log-prob
    (recompute mode) and critic passes (forward: 2 x weights x tokens) and the update (forward
    and backward: 6 x, for every epoch, actor and critic; 4 x for the actor's when `reused`: its
    forward was the old log-prob pass, actor/reused_old_forward; 0 x when its backward ran there
    too, actor/first_step_in_old_pass, whose 6 x then count in the old log-prob pass)."""
    from sealrl.obs.flops import matmul_weights, pass_metrics
    cfg, roles = run.cfg, run.roles
    device = str(getattr(roles.actor, "local", roles.actor).device)
    actor_w = matmul_weights(structure(roles.actor))
    critic_w = matmul_weights(structure(roles.critic)) if roles.critic is not None else 0
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
    prompts = {s.group_id: len(s.prompt_ids) for s in batch.samples}
    generated = sum(prompts.values()) + sum(len(s.response_ids) for s in batch.samples)
    critic_epochs = cfg.critic.ppo_epochs or cfg.actor.ppo_epochs
    actor_update = (6 * cfg.actor.ppo_epochs - (6 if stepped_there else 2 if reused else 0)) * actor_w
    flops = {"generate": 2 * actor_w * generated, "reference": 2 * actor_w * tokens,
             "critic_values": 2 * critic_w * tokens, "update": tokens * (actor_update + 6 * critic_w * critic_epochs),
             **({"old_log_prob": (6 if stepped_there else 2) * actor_w * tokens}
                if cfg.algorithm.old_log_prob == "recompute" else {})}
    out: dict[str, float] = {}
    for name, f in flops.items():
        if name in stage_seconds:
            out.update(pass_metrics(name, f, stage_seconds[name], device))
    return out
