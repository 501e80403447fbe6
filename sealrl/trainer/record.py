"""What an iteration leaves in the run folder besides checkpoints: the sealed experience
(Parquet), the group ledger, which replica served which sample (Ray placement), and the
iteration's metrics beyond those of its stages."""
from __future__ import annotations

import json

from sealrl.experience import ExperienceBatch
from sealrl.experience.store import write_iteration
from sealrl.roles.actor import loss_mask
from sealrl.trainer.iteration_metrics import batch_metrics, preparation_metrics, version_metrics
from sealrl.trainer.ledger import IterationLedger


def record(run, it: int, batch: ExperienceBatch, ledger: IterationLedger, version, served: list[dict]) -> dict:
    """Write the iteration's experience, ledger and served lines; return its record metrics."""
    cfg, roles = run.cfg, run.roles
    backend, dtype = roles.rollout.backend
    extra = {"old_log_prob_mode": cfg.algorithm.old_log_prob,
             "reference_version": roles.reference.version.id if roles.reference else "",
             "rollout_backend": backend, "rollout_dtype": dtype}
    write_iteration(run.dir / "experience", batch, consumed_step=roles.actor.step,
                    extra={k: [v] * len(batch) for k, v in extra.items()})
    _append(run.dir / "ledger.jsonl", ledger.rows())
    _append(run.dir / "served.jsonl", [{"iteration": it, **call} for call in served])
    metrics = batch_metrics(batch, loss_mask(batch, cfg.algorithm)[1], roles.actor.step, version.step)
    metrics.update(version_metrics(ledger.rows(), cfg.rollout.n, batch.group_ids, version.step))
    recomputed = ("old_log_prob",) if cfg.algorithm.old_log_prob == "recompute" else ()
    metrics.update(preparation_metrics(run.timer.stage_spans, batch, ("reference", "critic_values") + recomputed))
    return metrics


def _append(path, rows: list[dict]) -> None:
    if rows:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
