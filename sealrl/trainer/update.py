"""UPDATING_FROM(v): the critic and actor updates on the sealed batch (its advantages were
derived before the seal: prepare.advantages), rolled back and tried again when they fail; then
the adaptive KL controller's step."""
from __future__ import annotations

from sealrl.config import StoppedRun
from sealrl.experience import ExperienceBatch
from sealrl.roles.actor import RolloutMismatch
from sealrl.roles.common import NoRollback
from sealrl.trainer.iteration_metrics import ref_kl
from sealrl.trainer.state import StageFailed


def update_seed(cfg, it: int) -> int:
    """The seed of iteration `it`'s update (Clip-Cov's draw, the minibatch order)."""
    return cfg.run.seed * 100003 + it


def update(run, batch: ExperienceBatch, version, it: int) -> dict:
    cfg = run.cfg
    with run.stage("update", "actor"):
        metrics = update_with_rollback(run, batch, version, it)
    metrics["kl/beta"] = run.kl_ctl.beta          # the beta this iteration used (reward or loss)
    if cfg.algorithm.kl_target > 0:
        run.kl_ctl.update(ref_kl(batch), len(batch))
    return metrics


def actor_steps(actor_cfg, samples: int) -> int:
    """The optimizer steps of one actor update of `samples` samples: epochs x minibatches."""
    return actor_cfg.ppo_epochs * -(-samples // (actor_cfg.mini_batch_size or samples))


def update_with_rollback(run, batch: ExperienceBatch, version, it: int) -> dict:
    """Critic and actor updates. A failed update restores the committed weights and optimizer
    state and is tried again (update attempt + 1) up to run.update_retries times; the last
    failure is raised naming the stage. The actor's update comes last: when it is one optimizer
    step, that step commits it, and its snapshot keeps no copy (roles/common.Snapshot); a failure
    after that step stops the run, named, at the last checkpoint."""
    retries, roles = run.cfg.run.update_retries, run.roles
    one_step = actor_steps(run.cfg.actor, len(batch)) == 1
    for attempt in range(retries + 1):
        snaps = [(r, r.snapshot(copy=r is not roles.actor or not one_step))
                 for r in (roles.critic, roles.actor) if r is not None and retries]
        roles.actor.attempt = attempt
        try:
            seed = update_seed(run.cfg, it)
            metrics = roles.critic.update(batch, seed) if roles.critic is not None else {}
            metrics.update(roles.actor.update(batch, version, it, seed, kl_coef=run.kl_ctl.beta))
            metrics["update/attempts"] = attempt + 1
            return metrics
        except StoppedRun:   # a rank lost with its node: nothing to roll back on, nothing to retry
            raise
        except Exception as e:  # noqa: BLE001 - rolled back, retried, then re-raised
            for role, snap in snaps:
                try:
                    role.restore(snap)
                except Exception as err:  # noqa: BLE001 - from Ray ranks a NoRollback is a WorkerError's cause
                    lost = getattr(err, "cause", err)
                    if not isinstance(lost, NoRollback):
                        raise
                    raise StageFailed(f"iteration {it}: update failed at attempt {attempt + 1} "
                                      f"({type(e).__name__}: {e}) and cannot be rolled back: {lost}") from e
            if isinstance(e, RolloutMismatch):   # the same numbers every try: a named stop
                raise StageFailed(f"{e}; weights and optimizer restored, nothing of this iteration trained") from e
            if attempt == retries:
                raise StageFailed(f"iteration {it}: update failed at attempt {attempt + 1} "
                                   f"({type(e).__name__}: {e}); weights and optimizer restored") from e
    raise AssertionError("unreachable")
