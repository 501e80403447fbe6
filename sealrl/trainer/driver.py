"""The driver: one synchronous RL iteration after another, as the state machine of DESIGN
section 1. Setup lives in setup.py, the stages in collect.py (generate, score), prepare.py
(build, prepare, seal), update.py and record.py; saving/restoring the position in position.py.

    ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v)
      -> GENERATING(v) -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1)
"""
from __future__ import annotations

import json
import time

import torch

from sealrl.config import Config
from sealrl.models.lora import save_policy
from sealrl.obs.metrics import MetricsLogger
from sealrl.obs.progress import Progress
from sealrl.sync.adapter import sync_bytes
from sealrl.sync.manifest import in_dtype
from sealrl.trainer import drills, setup
from sealrl.trainer.collect import decode_and_score, generate
from sealrl.trainer.dynamic import oversample
from sealrl.trainer.episodes import episode_metrics, with_env_inputs
from sealrl.trainer.evaluate import evaluate
from sealrl.trainer.inputs import check_inputs, write_dropped_rows
from sealrl.trainer.iteration_metrics import rollout_metrics, share_metrics, stage_io_metrics
from sealrl.trainer.ledger import new_iteration
from sealrl.trainer.position import forget_after, restore_position, save_position
from sealrl.trainer.prepare import advantages, build_batch, prepare, seal
from sealrl.trainer.record import record
from sealrl.trainer.remax import greedy_baselines, put_baselines
from sealrl.trainer.setup import Run
from sealrl.trainer.state import Phase, StageFailed, committed_id
from sealrl.trainer.update import update


def train(cfg: Config) -> dict:
    """Run (or resume) a training run; returns the summary also written to summary.json.
    Scorer processes are closed and torch's thread count restored however the run ends."""
    check_inputs(cfg)   # paths and config rules, before anything is loaded or written
    threads = torch.get_num_threads()
    setup.make_deterministic(cfg)
    roles, lock = setup.build_roles(cfg, cfg.run.name), None
    try:
        data = setup.build_data(cfg, roles.tokenizer)   # every row checked before the run folder exists
        run_dir = setup.open_run_dir(cfg)
        lock = setup.lock_run_dir(run_dir)
        write_dropped_rows(run_dir, (data.train, data.eval))
        return _train(setup.build_run(cfg, run_dir, roles, data))
    finally:
        roles.close()
        if lock is not None:
            lock.close()
        torch.set_num_threads(threads)


def _train(run: Run) -> dict:
    cfg, roles, data = run.cfg, run.roles, run.data
    resumed = restore_position(run.dir, cfg, roles, run.sampler, run.kl_ctl, data.hash) \
        if cfg.run.resume == "auto" else None
    if resumed is None and (run.dir / "checkpoints" / "latest").exists():
        raise setup.ConfigError(f"run folder {run.dir} already has checkpoints; "
                                "use run.resume=auto or another run.name")
    start = resumed["iteration"] if resumed else 0
    forget_after(run.dir, start)
    drills.install(roles, start)   # fault drills: only when SEALRL_FAULTS is set
    setup.write_run_files(run.dir, cfg, {"run": cfg.run.seed}, {"data_hash": data.hash,
                                                                "num_train_prompts": len(data.train),
                                                                "dropped_train_rows": data.train.num_dropped})
    logger = MetricsLogger(run.dir, cfg.run.loggers)
    eval_kw = dict(reward_fn=setup.build_reward_fn(cfg), tokenizer=roles.tokenizer,
                   max_new_tokens=cfg.rollout.max_new_tokens, num=cfg.eval.num, pass_k=cfg.eval.pass_k,
                   temperature=cfg.eval.temperature, seed=cfg.run.seed, num_scorers=cfg.reward.num_scorers,
                   timeout_s=cfg.reward.timeout_s)
    version = publish(run)
    before = resumed["accuracy_before"] if resumed else evaluate(roles.rollout, version, data.eval, **eval_kw)
    wall = resumed["train_wall_s"] if resumed else 0.0
    progress = Progress(cfg.run.iterations, start, enabled=cfg.run.progress)
    it = start
    for it in range(start, cfg.run.iterations):
        t0 = time.perf_counter()
        metrics = run_iteration(run, it, version)
        if run.sm.committed != committed_id(version.id):   # else every step was skipped: nothing new
            version = publish(run)   # ACTOR_COMMITTED(v+1) -> ... -> ROLLOUT_READY(v+1)
        metrics["time/weight_sync_s"] = run.timer.stage_seconds.get("weight_sync", 0.0)
        metrics["sync/bytes"] = float(run.sync_bytes)
        metrics["time/iteration_s"] = time.perf_counter() - t0
        metrics.update(share_metrics(metrics))
        wall += metrics["time/iteration_s"]          # training time: evaluation is not counted
        metrics["time/train_wall_s"] = wall
        if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and it + 1 < cfg.run.iterations:
            metrics.update(evaluate(roles.rollout, version, data.eval, **eval_kw))
        logger.log(it, metrics)
        progress.update(it, metrics)
        last = it + 1 == cfg.run.iterations or (cfg.run.max_wall_s and wall >= cfg.run.max_wall_s)
        if last or (cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0):
            with run.stage("checkpoint", "driver"):
                save_position(run.dir, it + 1, cfg, roles, run.sampler, run.kl_ctl, data.hash,
                              {"accuracy_before": before, "train_wall_s": wall})
            run.to(Phase.CHECKPOINT_DURABLE, f"step_{it + 1}")
        run.timer.flush()
        if last:
            break
    progress.close()
    after = evaluate(roles.rollout, version, data.eval, **eval_kw)
    save_policy(roles.actor.model, roles.tokenizer, run.dir)   # LoRA: merged model/ and adapter/
    summary = {"accuracy_before": before.get("eval/accuracy"), "accuracy_after": after.get("eval/accuracy"),
               "wall_s": round(wall, 2), "iterations": it + 1, "algorithm": cfg.algorithm.name,
               "eval_before": before, "eval_after": after, "policy_version": version.id,
               "weights_hash": version.weights_hash,
               "optimizer_steps": roles.actor.step, "config_hash": cfg.hash(), "run_dir": str(run.dir),
               "completed": it + 1 == cfg.run.iterations}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.close()
    return summary


def publish(run: Run):
    """EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v): the rollout stages the actor's
    weights, verifies every checksum of the manifest, then switches its active version. A
    corrupted or missing tensor raises WeightSyncError naming it; nothing is activated."""
    with run.stage("weight_sync", "rollout"):
        state, manifest = in_dtype(*run.roles.actor.export(), run.cfg.rollout.dtype)  # checksums over what loads
        run.sync_bytes = sync_bytes(state)   # with LoRA, the adapter's tensors only
        run.to(Phase.EXPORTING, manifest.version.id)
        run.to(Phase.ROLLOUT_LOADING, manifest.version.id)
        version = run.roles.rollout.load(state, manifest)
        run.to(Phase.ROLLOUT_READY, version.id)
    return version


def run_iteration(run: Run, it: int, version) -> dict:
    """One iteration from the active version: generate, score, prepare, seal, update, record."""
    cfg, roles = run.cfg, run.roles
    run.timer.start_iteration(it)
    prompts = [run.data.train[i] for i in run.sampler.next_batch()]
    ledger, requests = new_iteration(it, cfg.rollout.n, cfg.rollout.max_retries, cfg.run.name, cfg.run.seed,
                                     [(p.prompt_id, p.token_ids) for p in prompts])
    prompt_map = dict(zip(requests, prompts))
    prompt_of = prompt_map.__getitem__
    requests = with_env_inputs(requests, prompt_of)   # the rows environments start from (multi-turn)
    run.to(Phase.GENERATING, version.id)   # every sample comes from the active version v, and only from it
    roles.rollout.take_served()   # forget who served the evaluation's calls
    with run.stage("generate", "rollout"):
        groups = generate(run, ledger, requests, version)
    served = roles.rollout.take_served()   # a replica pool: which replica served which sample id
    with run.stage("reward", "reward"):
        texts, records, kept = decode_and_score(run, ledger, groups, prompt_of)
    if cfg.algorithm.dynamic_sampling:   # DAPO: filter zero-variance groups, over-sample more rounds
        kept = oversample(run, it, version, ledger, groups, records, kept, prompt_map, texts, served)
    if cfg.algorithm.name == "remax":    # ReMax: the reward of a greedy response per prompt is the baseline
        kept, baselines = greedy_baselines(run, it, version, ledger, kept, prompt_map, served)
    ledger.commit(list(kept))
    metrics = {**ledger.counts(), **rollout_metrics(groups, records, run.timer.stage_seconds["generate"]),
               **stage_io_metrics(run.timer.stage_spans, groups, roles.rollout.take_recoveries()),
               **episode_metrics([s for ss in groups.values() for s in ss])}
    if not kept:
        raise StageFailed(f"iteration {it}: every group was dropped ({ledger.rows()[0]['reason']})")
    batch = build_batch(run, it, kept, records, prompt_of, texts, version)
    if cfg.algorithm.name == "remax":
        put_baselines(batch, baselines)
    prepare(run, batch, version)
    metrics.update(advantages(run, batch, it))
    seal(run, it, batch, ledger, served)       # durable before any update reads it
    run.to(Phase.EXPERIENCE_SEALED, version.id)
    run.to(Phase.UPDATING_FROM, version.id)    # critic and actor updates
    metrics.update(update(run, batch, version, it))
    stepped = roles.actor.step != version.step   # False when every optimizer step was skipped
    committed = f"{cfg.run.name}@{roles.actor.step}.{roles.actor.attempt}" if stepped else committed_id(version.id)
    run.to(Phase.ACTOR_COMMITTED, committed)
    metrics.update(record(run, it, batch, ledger, version, committed))
    metrics.update({f"time/{k}_s": v for k, v in run.timer.stage_seconds.items()})
    return metrics
