"""The driver: one synchronous RL iteration after another, as the state machine of DESIGN
section 1. Setup lives in setup.py, saving/restoring the position in position.py; this file is
the loop.

    ACTOR_COMMITTED(v) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v)
      -> GENERATING(v) -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v) -> ACTOR_COMMITTED(v+1)
"""
from __future__ import annotations

import json
import time

import torch

from sealrl import algos, faults
from sealrl.experience import (ExperienceBatch, RewardRecord, RewardStatus, Role, SampleMeta, SamplingContract,
                               pad_token_rows)
from sealrl.experience.store import write_iteration
from sealrl.models.hf import save_causal_lm
from sealrl.obs.metrics import MetricsLogger
from sealrl.obs.progress import Progress
from sealrl.trainer import setup
from sealrl.config import Config
from sealrl.trainer.derive import derive
from sealrl.trainer.evaluate import evaluate
from sealrl.trainer.iteration_metrics import (batch_metrics, from_stage_start, preparation_metrics, rollout_metrics,
                                              share_metrics, version_metrics)
from sealrl.trainer.ledger import new_iteration
from sealrl.trainer.position import forget_after, restore_position, save_position
from sealrl.trainer.state import Phase, StateMachine


def train(cfg: Config) -> dict:
    """Run (or resume) a training run; returns the summary also written to summary.json.
    Scorer processes are closed and torch's thread count restored however the run ends."""
    threads = torch.get_num_threads()
    setup.make_deterministic(cfg)
    run_dir = setup.open_run_dir(cfg)
    lock = setup.lock_run_dir(run_dir)
    roles = setup.build_roles(cfg, cfg.run.name)
    try:
        return _train(cfg, run_dir, roles)
    finally:
        roles.close()
        lock.close()
        torch.set_num_threads(threads)


def _train(cfg: Config, run_dir, roles) -> dict:
    data = setup.build_data(cfg, roles.tokenizer)
    sampler = setup.build_sampler(cfg, data)
    kl_ctl = (algos.AdaptiveKLController(cfg.algorithm.kl_coef, cfg.algorithm.kl_target, cfg.algorithm.kl_horizon)
              if cfg.algorithm.kl_target > 0 else algos.FixedKLController(cfg.algorithm.kl_coef))
    contract = SamplingContract(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                                stop_token_ids=(roles.tokenizer.eos_token_id,), n=cfg.rollout.n,
                                seed=cfg.run.seed)
    resumed = restore_position(run_dir, cfg, roles, sampler, kl_ctl, data.hash) if cfg.run.resume == "auto" else None
    if resumed is None and (run_dir / "checkpoints" / "latest").exists():
        raise setup.ConfigError(f"run folder {run_dir} already has checkpoints; use run.resume=auto or another run.name")
    start = resumed["iteration"] if resumed else 0
    forget_after(run_dir, start)
    setup.write_run_files(run_dir, cfg, {"run": cfg.run.seed}, {"data_hash": data.hash,
                                                                 "num_train_prompts": len(data.train),
                                                                 "dropped_train_rows": data.train.num_dropped})
    sm = StateMachine(run_dir / "trace.json", cfg.run.stage_timeout_s, roles.workers())
    logger = MetricsLogger(run_dir, cfg.run.loggers)
    eval_kw = dict(reward_fn=setup.build_reward_fn(cfg), tokenizer=roles.tokenizer,
                   max_new_tokens=cfg.rollout.max_new_tokens, num=cfg.eval.num, pass_k=cfg.eval.pass_k,
                   temperature=cfg.eval.temperature, seed=cfg.run.seed)
    version = sync_weights(roles, sm, start)
    before = resumed["accuracy_before"] if resumed else evaluate(roles.rollout, version, data.eval, **eval_kw)
    wall = resumed["train_wall_s"] if resumed else 0.0
    progress = Progress(cfg.run.iterations, start, enabled=cfg.run.progress)
    it = start
    for it in range(start, cfg.run.iterations):
        t0 = time.perf_counter()
        metrics = run_iteration(it, cfg, roles, data, sampler, kl_ctl, contract, sm, run_dir, version)
        version = sync_weights(roles, sm, it + 1)  # ACTOR_COMMITTED(v+1) -> ... -> ROLLOUT_READY(v+1)
        metrics["time/weight_sync_s"] = sm.stage_seconds["weight_sync"]
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
            with sm.stage("checkpoint", "driver"):
                save_position(run_dir, it + 1, cfg, roles, sampler, kl_ctl, data.hash,
                              {"accuracy_before": before, "train_wall_s": wall})
                faults.point("after_checkpoint", it + 1)
        sm.flush()
        if last:
            break
    progress.close()
    after = evaluate(roles.rollout, version, data.eval, **eval_kw)
    save_causal_lm(roles.actor.model, roles.tokenizer, run_dir / "model")
    summary = {"accuracy_before": before.get("eval/accuracy"), "accuracy_after": after.get("eval/accuracy"),
               "wall_s": round(wall, 2), "iterations": it + 1, "algorithm": cfg.algorithm.name,
               "eval_before": before, "eval_after": after, "policy_version": version.id,
               "weights_hash": version.weights_hash,
               "optimizer_steps": roles.actor.step, "config_hash": cfg.hash(), "run_dir": str(run_dir),
               "completed": it + 1 == cfg.run.iterations}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    logger.close()
    return summary


def sync_weights(roles, sm: StateMachine, iteration: int):
    """EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v): the rollout stages the actor's
    weights, verifies every checksum of the manifest, then switches its active version. A
    corrupted or missing tensor raises WeightSyncError naming it; nothing is activated."""
    with sm.stage("weight_sync", "rollout"):
        state, manifest = roles.actor.export()
        sm.to(Phase.EXPORTING, manifest.version.id)
        if faults.point("weight_sync", iteration) == "corrupt":
            name = next(iter(state))
            state[name] = state[name].clone().flatten().index_fill_(0, torch.tensor([0]), 1e3).view_as(state[name])
        sm.to(Phase.ROLLOUT_LOADING, manifest.version.id)
        version = roles.rollout.load(state, manifest)
        sm.to(Phase.ROLLOUT_READY, version.id)
    return version


def run_iteration(it, cfg: Config, roles, data, sampler, kl_ctl, contract, sm: StateMachine, run_dir, version) -> dict:
    sm.start_iteration(it)
    prompts = [data.train[i] for i in sampler.next_batch()]
    by_id = {p.prompt_id: p for p in prompts}
    ledger, requests = new_iteration(it, cfg.rollout.n, cfg.rollout.max_retries, cfg.run.name, cfg.run.seed,
                                     [(p.prompt_id, p.token_ids) for p in prompts])
    # GENERATING(v): every sample comes from the active version v, and only from it.
    sm.to(Phase.GENERATING, version.id)
    late = []   # (attempt, samples) of a generate call that missed its deadline (fault "late")

    def generate(reqs):
        """A failed generate call loses its samples; the ledger regenerates them with the
        same version and seeds, or drops their groups after the retry limit."""
        attempt = ledger.attempt
        try:
            fault = faults.point("rollout", it)
            samples = roles.rollout.generate(reqs, contract, version)
        except Exception as e:  # noqa: BLE001 - recorded, counted and retried below
            ledger.failures.append(f"rollout: {type(e).__name__}: {e}")
            return []
        if fault == "late":   # counted as failed and retried; its samples arrive after the retry's
            ledger.failures.append(f"rollout: attempt {attempt} missed its deadline (injected late delivery)")
            late.append((attempt, samples))
            return []
        return samples + samples if fault == "twice" else samples

    served = getattr(roles.rollout, "served", None)  # a replica pool: who served which sample id
    if served is not None:
        served.clear()
    with sm.stage("generate", "rollout"):
        timed = from_stage_start(generate, time.perf_counter())  # completion times on the stage's clock
        groups = ledger.complete(timed(list(requests.values())), timed, requests)
        for attempt, samples in late:   # refused by key and attempt, counted
            ledger.deliver(samples, attempt)
    if served:
        with open(run_dir / "served.jsonl", "a") as f:
            for call in served:
                f.write(json.dumps({"iteration": it, **call}) + "\n")
    texts: dict[str, str] = {}   # sample id -> response text, decoded once for reward and record

    def decode(s) -> str:
        if s.sample_id not in texts:
            texts[s.sample_id] = roles.tokenizer.decode(list(s.response_ids), skip_special_tokens=True)
        return texts[s.sample_id]
    prompt_of = lambda g: by_id[ledger.groups[g].prompt_id]  # noqa: E731
    with sm.stage("reward", "reward"):
        items = {s.sample_id: (s, prompt_of(g).text, decode(s), prompt_of(g).ground_truth, prompt_of(g).data_source)
                 for g, ss in groups.items() for s in ss}
        late_records = []   # (attempt, records) of a scoring call that missed its deadline (fault "late")
        score = lambda ids: ledger.score(ids, lambda attempt: score_or_error(  # noqa: E731
            roles.reward, [items[i] for i in ids], it, attempt, late_records), roles.reward.scorer)
        records = score(list(items))
        kept = ledger.apply_reward_policy(groups, records, cfg.algorithm.reward_error, score)
        for attempt, pairs in late_records:   # after the retry: refused by attempt, counted
            ledger.deliver_rewards(pairs, attempt)
    ledger.commit(list(kept))
    metrics = {**ledger.counts(), **rollout_metrics(groups, records, sm.stage_seconds["generate"])}
    if not kept:
        raise RuntimeError(f"iteration {it}: every group was dropped ({ledger.rows()[0]['reason']})")
    batch = build_batch(cfg, it, kept, records, prompt_of, decode, contract, version)
    if roles.reference is not None:
        with sm.stage("reference", "reference"):
            faults.point("reference", it)
            roles.reference.compute(batch)
    if roles.critic is not None:
        with sm.stage("critic_values", "critic"):
            roles.critic.compute(batch)
    with sm.stage("old_log_prob", "actor"):
        faults.point("old_log_prob", it)
        if cfg.algorithm.old_log_prob == "recompute":
            roles.actor.compute_old_log_probs(batch, version)
        else:  # bypass: the behaviour log-probs are the proximal anchor
            batch.put("old_log_probs", batch.get("rollout_log_probs").clone(), Role.ROLLOUT, version.id)
    batch.seal(required=("response_mask", "rollout_log_probs", "reward_records", "old_log_probs"))
    sm.to(Phase.EXPERIENCE_SEALED, version.id)
    # UPDATING_FROM(v): advantages on the driver, then critic and actor updates.
    sm.to(Phase.UPDATING_FROM, version.id)
    with sm.stage("advantage", "driver"):
        metrics.update(derive(batch, cfg.algorithm, kl_ctl.beta, cfg.rollout.max_new_tokens, f"{cfg.algorithm.name}@{it}"))
    with sm.stage("update", "actor"):
        metrics.update(update_with_rollback(cfg, roles, batch, version, it))
    metrics.update(batch_metrics(batch, roles.actor.step, version.step))
    metrics.update(version_metrics(ledger.rows(), cfg.rollout.n, batch.group_ids, version.step))
    recomputed = ("old_log_prob",) if cfg.algorithm.old_log_prob == "recompute" else ()
    metrics.update(preparation_metrics(sm.stage_spans, batch, ("reference", "critic_values") + recomputed))
    metrics["kl/beta"] = kl_ctl.beta          # the beta this iteration used
    if cfg.algorithm.kl_target > 0:
        kl_ctl.update(metrics.get("kl/ref_kl", 0.0), len(batch))
    sm.to(Phase.ACTOR_COMMITTED, f"step{roles.actor.step}")
    write_iteration(run_dir / "experience", batch, consumed_step=roles.actor.step,
                    extra={"old_log_prob_mode": [cfg.algorithm.old_log_prob] * len(batch),
                           "reference_version": [roles.reference.version.id if roles.reference else ""] * len(batch)})
    with open(run_dir / "ledger.jsonl", "a") as f:
        for row in ledger.rows():
            f.write(json.dumps(row) + "\n")
    metrics.update({f"time/{k}_s": v for k, v in sm.stage_seconds.items()})
    return metrics


def score_or_error(reward, items, it, attempt, late) -> list[tuple[str, RewardRecord]]:
    """(sample id, record) pairs from the reward role, for the ledger to join by sample id; if
    the role itself fails, every sample gets an error record naming it (never a score), and the
    reward-error policy decides."""
    try:
        fault = faults.point("reward", it)
        pairs = reward.score(items)
    except Exception as e:  # noqa: BLE001 - becomes error records, counted by the ledger
        msg = f"reward role failed: {type(e).__name__}: {e}"
        return [(s.sample_id, RewardRecord.failure(RewardStatus.ERROR, "reward-role", msg)) for s, *_ in items]
    if fault == "late":   # the call times out; its records arrive after the policy's retry
        late.append((attempt, pairs))
        msg = f"reward role: no records within the deadline (attempt {attempt}, injected late delivery)"
        return [(s.sample_id, RewardRecord.failure(RewardStatus.TIMEOUT, "reward-role", msg)) for s, *_ in items]
    return pairs + pairs if fault == "twice" else pairs


def update_with_rollback(cfg: Config, roles, batch, version, it) -> dict:
    """Critic and actor updates. A failed update restores the committed weights and optimizer
    state and is tried again (update attempt + 1) up to run.update_retries times; the last
    failure is raised naming the stage."""
    for attempt in range(cfg.run.update_retries + 1):
        snaps = [(r, r.snapshot()) for r in (roles.critic, roles.actor) if r is not None and cfg.run.update_retries]
        roles.actor.attempt = attempt
        try:
            faults.point("actor_update", it)
            metrics = roles.critic.update(batch) if roles.critic is not None else {}
            metrics.update(roles.actor.update(batch, version, it, seed=cfg.run.seed * 100003 + it))
            metrics["update/attempts"] = attempt + 1
            return metrics
        except Exception as e:  # noqa: BLE001 - rolled back, retried, then re-raised
            for role, snap in snaps:
                role.restore(snap)
            if attempt == cfg.run.update_retries:
                raise RuntimeError(f"iteration {it}: update failed at attempt {attempt + 1} "
                                   f"({type(e).__name__}: {e}); weights and optimizer restored") from e
    raise AssertionError("unreachable")


def build_batch(cfg, it, kept, records, prompt_of, decode, contract, version) -> ExperienceBatch:
    """EXPERIENCE facts from complete groups: identity, tokens, stop reasons, rollout log-probs."""
    samples = [s for g in kept for s in kept[g]]
    metas = [SampleMeta(sample_id=s.sample_id, group_id=s.group_id, prompt_id=prompt_of(s.group_id).prompt_id,
                        prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids),
                        stop_reason=s.stop_reason, policy_version=s.policy_version.id, seed=s.seed,
                        prompt_text=prompt_of(s.group_id).text, response_text=decode(s),
                        data_source=prompt_of(s.group_id).data_source,
                        ground_truth=json.dumps(prompt_of(s.group_id).ground_truth, sort_keys=True))
             for s in samples]
    batch = ExperienceBatch(cfg.run.name, it, metas, contract, [version])
    width = batch.num_response_tokens
    batch.put("response_mask", pad_token_rows([[1] * len(s.response_ids) for s in samples], width, torch.bool),
              Role.ROLLOUT, version.id)
    batch.put("rollout_log_probs", pad_token_rows([s.rollout_log_probs for s in samples], width, torch.float32),
              Role.ROLLOUT, version.id)
    if contract.filtered:
        batch.put("filtered_log_probs", pad_token_rows([s.filtered_log_probs for s in samples], width, torch.float32),
                  Role.ROLLOUT, version.id)
    first = records[samples[0].sample_id]
    batch.put("reward_records", [records[s.sample_id] for s in samples], Role.REWARD,
              f"{first.scorer}@{first.scorer_version}" if first.scorer_version else "")
    return batch
