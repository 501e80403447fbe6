"""The driver: one RL iteration after another, as the state machine of DESIGN section 1. Setup
lives in setup.py, the stages in collect.py (generate, score), prepare.py (build, prepare,
seal), update.py and record.py; saving/restoring the position in position.py; the generation
lane and the staleness bound (rollout.max_staleness; 0 = synchronous) in pipeline.py.

    ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v)
      -> GENERATING(v) -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1)
"""
from __future__ import annotations

import json
import sys
import time

import torch

from sealrl.config import Config, StoppedRun
from sealrl.obs.metrics import MetricsLogger
from sealrl.obs.progress import Progress
from sealrl.obs.timeline import critical_shares
from sealrl.sync.adapter import sync_bytes
from sealrl.sync.remote import RemoteState
from sealrl.trainer import drills, setup
from sealrl.trainer.evaluate import evaluate
from sealrl.trainer.inputs import check_inputs, write_dropped_rows
from sealrl.trainer.iteration_metrics import perf_metrics, share_metrics
from sealrl.trainer.memory import hold_freed_memory
from sealrl.trainer.pipeline import admit, pipeline, staleness_metrics
from sealrl.trainer.prepare import build_batch, prepare, seal
from sealrl.trainer.quarantine import quarantine_dropped
from sealrl.trainer.record import record
from sealrl.trainer.resume.position import (
    forget_after,
    forget_sealed_after,
    restore_position,
    save_final_policy,
    save_position,
)
from sealrl.trainer.resume.retained import recall
from sealrl.trainer.setup import Run
from sealrl.trainer.state import Phase, committed_id
from sealrl.trainer.stopping import graceful_stop
from sealrl.trainer.update import update
from sealrl.trainer.variants.remax import put_baselines
from sealrl.trainer.watchdog import record_failure, watch_ray_head


def train(cfg: Config, schedule: dict[int, int] | None = None) -> dict:
    """Run (or resume) a training run; returns the summary also written to summary.json.
    Scorer processes are closed and torch's thread count restored however the run ends.
    `schedule` (a replay's, trainer/offline/replay.py): iteration -> the iteration whose consuming
    version samples it, instead of the fixed lag."""
    check_inputs(cfg)   # paths and config rules, before anything is loaded or written
    threads = torch.get_num_threads()
    if cfg.run.hold_freed_memory:
        hold_freed_memory()   # freed activations stay in the heap for the next pass (memory.py)
    setup.make_deterministic(cfg)
    roles, lock, run_dir, unwatch = setup.build_roles(cfg, cfg.run.name), None, None, None
    try:
        data = setup.build_data(cfg, roles.tokenizer)   # every row checked before the run folder exists
        run_dir = setup.open_run_dir(cfg)
        lock = setup.lock_run_dir(run_dir)
        if cfg.placement.backend == "ray":   # the head lost: a named stop, not Ray's abort 60 s later
            unwatch = watch_ray_head(run_dir, cfg.placement.head_grace_s)
        write_dropped_rows(run_dir, (data.train, data.eval))
        return _train(setup.build_run(cfg, run_dir, roles, data), schedule)
    except StoppedRun as e:   # e.g. a data-parallel rank lost with its node: a named state
        if run_dir is not None:
            record_failure(run_dir, e.failure, str(e))
        raise
    finally:
        roles.close()   # watched too: closing Ray's pools waits on the head
        if unwatch is not None:
            unwatch()
        if lock is not None:
            lock.close()
        torch.set_num_threads(threads)


def _train(run: Run, schedule: dict[int, int] | None = None) -> dict:
    cfg, roles, data = run.cfg, run.roles, run.data
    resumed = restore_position(run.dir, cfg, roles, run.sampler, run.kl_ctl, data.hash) \
        if cfg.run.resume == "auto" else None
    if resumed is None and any((run.dir / "checkpoints").glob("step_*")):
        raise setup.ConfigError(f"run folder {run.dir} already has checkpoints; "
                                "use run.resume=auto or another run.name")
    start = resumed["iteration"] if resumed else 0
    forget_after(run.dir, start)
    drills.install(roles, start)   # fault drills: only when SEALRL_FAULTS is set
    setup.write_run_files(run.dir, cfg, {"run": cfg.run.seed}, {"data_hash": data.hash,
                                                                "num_train_prompts": len(data.train),
                                                                "dropped_train_rows": data.train.num_dropped})
    setup.write_placement(run.dir)   # which node and host run each Ray worker
    logger = MetricsLogger(run.dir, cfg.run.loggers)
    eval_kw = dict(reward_fn=roles.reward.fn, tokenizer=roles.tokenizer,   # built once, at setup
                   max_new_tokens=cfg.rollout.max_new_tokens, num=cfg.eval.num, pass_k=cfg.eval.pass_k,
                   temperature=cfg.rollout.temperature, seed=cfg.run.seed, num_scorers=cfg.reward.num_scorers,
                   timeout_s=cfg.reward.timeout_s, memory_mb=cfg.reward.scorer_memory_mb)
    recalled = recall(run, resumed) if resumed else {}   # k >= 1: the versions the lane still samples from
    version = publish(run)
    before = resumed["accuracy_before"] if resumed else held_out(run, version, eval_kw)
    wall = resumed["train_wall_s"] if resumed else 0.0
    progress = Progress(cfg.run.iterations, start, enabled=sys.stderr.isatty())   # a bar on a terminal only
    with graceful_stop() as stop, pipeline(run, start, cfg.run.iterations, version, recalled, schedule) as lanes:
        done, version, wall = _loop(run, lanes, start, version, before, wall, logger, progress, eval_kw, stop)
    progress.close()
    forget_sealed_after(run.dir, done)   # a resumed run stopped (run.max_wall_s) before what it had sealed
    # A requested stop ends at its checkpoint: no final evaluation, which can take minutes.
    after = {} if stop.requested else held_out(run, version, eval_kw)
    if not stop.requested:
        save_final_policy(roles, run.dir)
    summary = {"accuracy_before": before.get("eval/accuracy"), "accuracy_after": after.get("eval/accuracy"),
               "wall_s": round(wall, 2), "iterations": done, "algorithm": cfg.algorithm.name,
               "eval_before": before, "eval_after": after, "policy_version": version.id,
               "weights_hash": version.weights_hash,
               "optimizer_steps": roles.actor.step, "config_hash": cfg.hash(), "run_dir": str(run.dir),
               "completed": done == cfg.run.iterations,
               "stopped_by": stop.signal.name if stop.requested else None, "exit_status": stop.exit_status}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.close()
    return summary


def _loop(run: Run, lanes, start: int, version, before: dict, wall: float, logger, progress, eval_kw, stop):
    """The iterations start .. run.iterations - 1 (or until run.max_wall_s, or a stop signal:
    stopping.py); returns the number of iterations done (the checkpoint's), the active version
    and the training wall time."""
    cfg, roles, data = run.cfg, run.roles, run.data
    done = start   # a resumed run that had finished does no iteration
    for it in range(start, cfg.run.iterations):
        t0 = time.perf_counter()
        metrics = run_iteration(run, it, version, lanes)
        if run.sm.committed != committed_id(version.id):   # else every step was skipped: nothing new
            version = publish(run)   # ACTOR_COMMITTED(v+1) -> ... -> ROLLOUT_READY(v+1)
        lanes.publish(it + 1, version, run.last_weights)   # the actor version that consumes iteration it + 1
        metrics["time/weight_sync_s"] = run.timer.stage_seconds.get("weight_sync", 0.0)
        metrics["sync/bytes"] = float(run.sync_bytes)
        metrics["sync/driver_bytes"] = float(run.sync_driver_bytes)
        metrics.update(run.timer.memory_metrics())   # peak memory per stage and role, weight sync included
        metrics["time/iteration_s"] = time.perf_counter() - t0
        metrics.update(share_metrics(metrics))
        metrics.update(critical_shares(run.timer.critical_seconds(), metrics["time/iteration_s"]))
        wall += metrics["time/iteration_s"]          # training time: evaluation is not counted
        metrics["time/train_wall_s"] = wall
        if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and it + 1 < cfg.run.iterations:
            with lanes.exclusive():
                metrics.update(held_out(run, version, eval_kw))
        logger.log(it, metrics)
        setup.write_placement(run.dir)   # a replica replaced this iteration: where it runs now
        progress.update(it, metrics)
        done = it + 1
        last = done == cfg.run.iterations or (cfg.run.max_wall_s and wall >= cfg.run.max_wall_s) or stop.requested
        if last or (cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0):
            with run.stage("checkpoint", "driver"):
                save_position(run.dir, it + 1, cfg, roles, SamplerAt(lanes.sampler_state(it + 1)), run.kl_ctl,
                              data.hash, {"accuracy_before": before, "train_wall_s": wall}, lanes.retained(it + 1))
            run.to(Phase.CHECKPOINT_DURABLE, f"step_{it + 1}")
        run.timer.flush()
        if last:
            break
    return done, version, wall


def held_out(run: Run, version, eval_kw: dict) -> dict:
    """The held-out evaluation, under the stage deadline like every stage (its reward code too)."""
    t = run.timer
    with run.watchdog.guard("evaluate", "rollout", t.worker("rollout"), t.iteration, version.id):
        return evaluate(run.roles.rollout, version, run.data.eval, **eval_kw)


class SamplerAt:
    """The prompt sampler's position at a checkpoint's iteration (the generation lane may have
    sampled further): what save_position records."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def publish(run: Run):
    """EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v): the rollout stages the actor's
    weights, verifies every checksum of the manifest, then switches its active version. A
    corrupted or missing tensor raises WeightSyncError naming it; nothing is activated."""
    with run.stage("weight_sync", "rollout"):
        # checksums over what loads: the rollout's dtype, or an adapter on the base the rollout pinned
        # data-parallel ranks on Ray: a RemoteState, the tensors in the object store (sync/remote.py)
        state, manifest = run.roles.actor.publish(run.cfg.rollout.dtype, run.roles.rollout_base)
        remote = isinstance(state, RemoteState)
        run.sync_bytes = state.nbytes if remote else sync_bytes(state)   # with LoRA, the adapter's tensors only
        run.sync_driver_bytes = 0 if remote else run.sync_bytes
        run.last_weights = state if run.cfg.rollout.max_staleness else None   # only an async lane keeps them
        run.to(Phase.EXPORTING, manifest.version.id)
        run.to(Phase.ROLLOUT_LOADING, manifest.version.id)
        version = run.roles.rollout.load(state, manifest)
        run.to(Phase.ROLLOUT_READY, version.id)
        del state
    return version


def run_iteration(run: Run, it: int, version, lanes) -> dict:
    """One iteration of the training lane: take in iteration `it`'s scored groups (sampled by
    the active `version`, or one up to rollout.max_staleness publications before it), admit
    those within the bound, then prepare, seal, update from the actor's `version`, record."""
    cfg, roles = run.cfg, run.roles
    run.timer.start_iteration(it)
    sampled_by = lanes.sampled_by(it)
    run.to(Phase.GENERATING, sampled_by.id)   # k = 0: every sample comes from the active version, only from it
    p = lanes.get(it)
    ages = admit(p, lanes.chain, version.id, lanes.bound)
    metrics = p.metrics
    quarantine_dropped(run.dir, it, p)   # what each dropped group held, before anything is sealed
    batch = build_batch(run, it, p.kept, p.records, p.prompt_of, p.texts, p.version)
    if p.baselines is not None:   # ReMax: the greedy baseline of each group, a sealed fact
        put_baselines(batch, p.baselines)
    metrics.update(prepare(run, batch, version, it))   # old log-probs: the actor's version (the proximal one)
    batch = run.variants.before_seal(run, batch, version, p, it, metrics)   # mismatch_action=drop_group
    seal(run, it, batch, p.ledger, p.served)   # durable before any update reads it
    run.to(Phase.EXPERIENCE_SEALED, p.version.id)
    run.to(Phase.UPDATING_FROM, p.version.id)  # critic and actor updates
    metrics.update(update(run, batch, version, it))
    stepped = roles.actor.step != version.step   # False when every optimizer step was skipped
    committed = f"{cfg.run.name}@{roles.actor.step}.{roles.actor.attempt}" if stepped else committed_id(version.id)
    run.to(Phase.ACTOR_COMMITTED, committed)
    metrics.update(record(run, it, batch, p.ledger, p.version, committed))
    if lanes.bound:
        metrics.update(staleness_metrics(ages, lanes.bound))
    metrics.update({f"time/{k}_s": v for k, v in run.timer.stage_seconds.items()})
    metrics.update(perf_metrics(run, batch, run.timer.stage_seconds, bool(metrics.get("actor/reused_old_forward")),
                                bool(metrics.get("actor/first_step_in_old_pass"))))
    return metrics
