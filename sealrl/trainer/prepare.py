"""From complete, scored groups to sealed, persisted experience: the batch's facts (identity,
tokens, stop reasons, rollout log-probs, reward records), then the teacher-forced fields each
from its own role (reference log-probs, critic values, old log-probs), the advantages derived on
the driver, then the seal, written to the run folder before the driver enters
EXPERIENCE_SEALED."""
from __future__ import annotations

import json

import torch

from sealrl.experience import ExperienceBatch, RewardRecord, Role, SampleMeta, pad_token_rows
from sealrl.experience.store import iteration_path, write_iteration
from sealrl.experience.wire import RolloutSample
from sealrl.trainer.derive import derive
from sealrl.trainer.ledger import IterationLedger
from sealrl.trainer.resume.position import sealed_before
from sealrl.trainer.update import update_seed
from sealrl.trainer.variants.episodes import action_masks, put_episode_facts
from sealrl.trainer.variants.partial import put_token_versions, span_versions


def build_batch(run, it: int, kept: dict[str, list[RolloutSample]], records: dict[str, RewardRecord],
                prompt_of, texts: dict[str, str], version) -> ExperienceBatch:
    """EXPERIENCE facts from complete groups. `prompt_of(group id)` is the group's prompt;
    `texts` the decoded response of each sample id."""
    samples = [s for g in kept for s in kept[g]]
    metas = [SampleMeta(sample_id=s.sample_id, group_id=s.group_id, prompt_id=prompt_of(s.group_id).prompt_id,
                        prompt_ids=tuple(s.prompt_ids), response_ids=tuple(s.response_ids),
                        stop_reason=s.stop_reason, policy_version=s.policy_version.id, seed=s.seed,
                        prompt_text=prompt_of(s.group_id).text, response_text=texts[s.sample_id],
                        data_source=prompt_of(s.group_id).data_source,
                        ground_truth=json.dumps(prompt_of(s.group_id).ground_truth, sort_keys=True))
             for s in samples]
    contract = run.contract
    batch = ExperienceBatch(run.cfg.run.name, it, metas, contract, span_versions(samples, version))
    width = batch.num_response_tokens
    batch.put("response_mask", pad_token_rows(action_masks(samples), width, torch.bool), Role.ROLLOUT, version.id)
    put_episode_facts(batch, samples, version.id)   # multi-turn only: observation holes, step rewards, turns
    put_token_versions(batch, samples, version.id)  # partial rollouts only: the version of each token
    batch.put("rollout_log_probs", pad_token_rows([s.rollout_log_probs for s in samples], width, torch.float32),
              Role.ROLLOUT, version.id)
    if contract.filtered:
        batch.put("filtered_log_probs", pad_token_rows([s.filtered_log_probs for s in samples], width, torch.float32),
                  Role.ROLLOUT, version.id)
    first = records[samples[0].sample_id]
    batch.put("reward_records", [records[s.sample_id] for s in samples], Role.REWARD,
              f"{first.scorer}@{first.scorer_version}" if first.scorer_version else "")
    return batch


def prepare(run, batch: ExperienceBatch, version, it: int) -> dict:
    """Reference log-probs (when a KL term is on), critic values (PPO), old log-probs
    (recomputed by the actor before any update, or the behaviour log-probs themselves: bypass)
    and the advantages; returns the advantages' metrics. Advantages that read no old log-probs
    are derived first, so that the actor may run its update's one step as the old log-prob
    pass (Actor.compute_old_log_probs); they are the same numbers in either order."""
    roles, algo = run.roles, run.cfg.algorithm
    early = not reads_old_log_probs(algo)
    metrics = {}
    if roles.reference is not None:
        with run.stage("reference", "reference"):
            roles.reference.compute(batch)
    if roles.critic is not None:
        with run.stage("critic_values", "critic"):
            roles.critic.compute(batch)
    if early:
        metrics = advantages(run, batch, it)
    with run.stage("old_log_prob", "actor"):
        if algo.old_log_prob == "recompute":
            fuse = (it, update_seed(run.cfg, it), run.kl_ctl.beta) if early else None
            roles.actor.compute_old_log_probs(batch, version, fuse)
        else:  # bypass: the behaviour log-probs are the proximal anchor
            batch.put("old_log_probs", batch.get("rollout_log_probs").clone(), Role.ROLLOUT, version.id)
    run.variants.extra_facts(run, batch, version)   # the optimal-token baseline's sum of pi^2 (trainer/variants)
    return metrics if early else advantages(run, batch, it)


def reads_old_log_probs(algo) -> bool:
    """Whether deriving the advantages reads the old log-probs (trainer/derive.py): the KL
    penalty in the reward, the optimal-token baseline."""
    return (algo.kl_coef > 0 and algo.kl_in == "reward") or algo.name == "optimal_token_baseline"


def advantages(run, batch: ExperienceBatch, it: int) -> dict:
    """Token rewards, returns and advantages from the facts (derived fields: outside the seal,
    recomputable offline by `sealrl recompute`); returns their metrics."""
    cfg = run.cfg
    with run.stage("advantage", "driver"):
        return derive(batch, cfg.algorithm, run.kl_ctl.beta, cfg.rollout.max_new_tokens,
                      f"{cfg.algorithm.name}@{it}")


def seal(run, it: int, batch: ExperienceBatch, ledger: IterationLedger, served: list[dict]) -> None:
    """Seal the facts and make the iteration durable: its experience file (fsynced), the
    ledger's outcome of every sampled group and, under Ray placement, which replica served which
    sample. Only then may an update read the batch; which step consumed it is recorded after."""
    batch.seal(required=("response_mask", "rollout_log_probs", "reward_records", "old_log_probs"))
    roles, cfg = run.roles, run.cfg
    backend, dtype = roles.rollout.backend
    extra = {"old_log_prob_mode": cfg.algorithm.old_log_prob,
             "reference_version": roles.reference.version.id if roles.reference else "",
             "rollout_backend": backend, "rollout_dtype": dtype}
    if not sealed_before(iteration_path(run.dir / "experience", it), batch):   # a resume's, written once
        write_iteration(run.dir / "experience", batch, extra={k: [v] * len(batch) for k, v in extra.items()})
    append_lines(run.dir / "ledger.jsonl", ledger.rows())
    append_lines(run.dir / "served.jsonl", [{"iteration": it, **call} for call in served])


def append_lines(path, rows: list[dict]) -> None:
    if rows:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
