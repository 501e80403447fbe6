"""algorithm.mismatch_action=drop_group: before the seal, each sampled token's log-prob under the
training forward of the weights that sampled is compared with the rollout's; a group with a token
past algorithm.mismatch_tol is dropped (a ledger reason, its content in the quarantine) and the
others train, where `stop` (the default) would end the run at the update's first step.

With old_log_prob=recompute the comparison reads the old log-probs (no extra pass; a fused first
step is then run again on the smaller batch); with bypass it costs one forward of the batch. With
rollout.max_staleness >= 1 the consuming version is compared, so the gap includes the lag, as for
`stop` (docs/metrics.md, logprob/current_vs_rollout).
"""
from __future__ import annotations

import torch

from sealrl.experience import ExperienceBatch


def group_gaps(batch: ExperienceBatch, current: torch.Tensor) -> dict[str, float]:
    """The largest |current - rollout| log-prob over each group's action tokens (clamped at 20
    nats, as the update's own measure)."""
    diff = (current.float() - batch.get("rollout_log_probs").float()).clamp(-20.0, 20.0).abs()
    worst = diff.masked_fill(~batch.get("response_mask"), 0.0).amax(dim=1).tolist() if len(batch) else []
    out: dict[str, float] = {}
    for g, w in zip(batch.group_ids, worst):
        out[g] = max(out.get(g, 0.0), w)
    return out


def drop_mismatched(run, batch: ExperienceBatch, version, produced, it: int, metrics: dict) -> ExperienceBatch:
    """`batch` without the groups past the tolerance (the same object when none is); the ledger,
    the quarantine, the group counts and the advantages follow."""
    from sealrl.trainer.prepare import advantages
    from sealrl.trainer.quarantine import quarantine_dropped
    algo = run.cfg.algorithm
    with run.stage("mismatch_check", "actor"):
        if algo.old_log_prob == "recompute":
            current = batch.get("old_log_probs")
        else:   # bypass: the old log-probs are the rollout's; one training forward, for this check only
            probe = batch.select(range(len(batch)), derived=False, without=("old_log_probs",))
            run.roles.actor.compute_old_log_probs(probe, version)
            current = probe.get("old_log_probs")
        gaps = group_gaps(batch, current)
    over = {g: gap for g, gap in gaps.items() if gap > algo.mismatch_tol}
    metrics["groups/mismatch_dropped"] = float(len(over))
    if not over:
        return batch
    for g, gap in over.items():
        produced.ledger.drop(g, f"train-vs-rollout mismatch {gap:.3g} nats on a sampled token > "
                                f"algorithm.mismatch_tol={algo.mismatch_tol:g}")
        produced.kept.pop(g, None)
    metrics.update({k: v for k, v in produced.ledger.counts().items() if k.startswith("groups/")})
    quarantine_dropped(run.dir, it, produced)   # the iteration's dropped groups, these included
    kept = batch.select([i for i, g in enumerate(batch.group_ids) if g not in over], derived=False)
    metrics.update(advantages(run, kept, it))   # over the groups that stay (a batch-wide whitening included)
    return kept
