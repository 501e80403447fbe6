"""What an iteration leaves in the run folder once its update is committed: which optimizer
step consumed the sealed batch, and the iteration's metrics beyond those of its stages. (The
experience, ledger and served lines were written when the batch was sealed: prepare.seal.)"""
from __future__ import annotations

from sealrl.experience import ExperienceBatch
from sealrl.experience.store import append_consumed
from sealrl.roles.actor import loss_mask
from sealrl.trainer.iteration_metrics import batch_metrics, preparation_metrics, version_metrics
from sealrl.trainer.ledger import IterationLedger


def record(run, it: int, batch: ExperienceBatch, ledger: IterationLedger, version, committed: str) -> dict:
    """Record the consumption of iteration `it`'s batch; return its record metrics."""
    cfg, roles = run.cfg, run.roles
    append_consumed(run.dir / "experience", it, roles.actor.step, version.id, committed, batch.seal_digest)
    metrics = batch_metrics(batch, loss_mask(batch, cfg.algorithm)[1], roles.actor.step, version.step)
    metrics.update(version_metrics(ledger.rows(), cfg.rollout.n, batch.group_ids, version.step))
    recomputed = ("old_log_prob",) if cfg.algorithm.old_log_prob == "recompute" else ()
    metrics.update(preparation_metrics(run.timer.stage_spans, batch, ("reference", "critic_values") + recomputed))
    return metrics
