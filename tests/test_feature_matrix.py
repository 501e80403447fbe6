"""The feature matrix: each of the twelve features a user reaches for, on one machine and on Ray
with 2 data-parallel actor ranks (FSDP2) and 2 rollout replicas; two iterations each, then the
audit. A Ray cell also samples iteration 0 exactly as the local cell does (same version, same
seeds: the same sample ids and tokens), and both replicas and both ranks took part.

Every combination left refused at load is listed in README.md ("What is refused"); a refused
pair of these features would fail its cell here instead of being silently skipped.
"""
from __future__ import annotations

import json

import pytest

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.experience.store import read_iteration
from sealrl.trainer.driver import train
from tests.harness import local_ray, small_args

ASYNC = ["rollout.max_staleness=1", "algorithm.old_log_prob=recompute", "algorithm.correction=token_is"]
FEATURES = {
    "grpo": [],
    "ppo": ["algorithm.name=ppo", "critic.lr=3e-4"],
    "lora": ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=5e-3"],
    "async": ASYNC,
    "partial": [*ASYNC, "rollout.partial=switch"],
    "tools": ["env.name=calc", "env.max_turns=2", "env.max_tokens=12", "env.max_observation_tokens=6",
              "data.task=mul3"],
    # n = 8 and seed 1: groups with signal on the shipped warm start within 4 rounds
    "dynamic": ["algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4", "run.seed=1", "rollout.n=8"],
    "remax": ["algorithm.name=remax"],
    "stream": ["reward.num_scorers=1", "reward.stream=true"],
    "bf16": ["rollout.dtype=bf16", "algorithm.old_log_prob=recompute"],
    # the fast training path is the default (lean forward, shared prompts, fused AdamW); here with
    # micro-batches smaller than the batch, so the shared-prompt and token-budget paths both run
    "fast": ["actor.micro_batch_size=4"],
    "process": [*ASYNC, "rollout.lane=process"],
}
RAY = ["placement.backend=ray", "placement.rollout_replicas=2", "placement.actor_ranks=2",
       "placement.dp_strategy=fsdp2", "placement.cpus_per_replica=0.5", "placement.cpus_per_rank=0.5",
       "placement.timeout_s=120"]
BASE = small_args("run.checkpoint_every=1", "data.num_train=64", "eval.num=8", "actor.micro_batch_size=8")


@pytest.fixture(scope="module")
def ray_session():
    pytest.importorskip("ray", reason="placement.backend=ray needs ray (the test extra)")
    local_ray()   # the process's shared local Ray (tests/harness.py), left up for the next Ray test


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    return tmp_path_factory.mktemp("local"), {}


def _run(root, feature, *extra) -> tuple[dict, object]:
    """(summary, run folder) of a two-iteration run of `feature` in root/feature."""
    summary = train(build_config(None, [*BASE, *FEATURES[feature], *extra, f"run.output_dir={root}",
                                        f"run.name={feature}"]))
    return summary, root / feature


def _local(local_runs, feature):
    root, done = local_runs
    if feature not in done:
        done[feature] = _run(root, feature)
    return done[feature]


@pytest.mark.parametrize("feature", list(FEATURES))
def test_local_cell(local_runs, feature):
    summary, run_dir = _local(local_runs, feature)
    assert summary["completed"] and summary["iterations"] == 2
    report = audit_run(run_dir)
    assert not report.failed_checks(), report.summary()


@pytest.mark.slow
@pytest.mark.parametrize("feature", list(FEATURES))
def test_ray_cell(ray_session, local_runs, tmp_path, feature):
    extra = ["placement.critic_ranks=2"] if feature == "ppo" else []
    summary, run_dir = _run(tmp_path, feature, *RAY, *extra)
    assert summary["completed"] and summary["iterations"] == 2
    report = audit_run(run_dir)
    assert not report.failed_checks(), report.summary()
    local = read_iteration(_local(local_runs, feature)[1] / "experience" / "iter_000000.parquet")
    remote = read_iteration(run_dir / "experience" / "iter_000000.parquet")
    assert remote.sample_ids == local.sample_ids   # the initial version, the same seeds: the same samples
    assert [s.response_ids for s in remote.samples] == [s.response_ids for s in local.samples]
    served = [json.loads(x) for x in (run_dir / "served.jsonl").read_text().splitlines()]
    replicas = {k for row in served for k in row.get("replica_of", {}).values()}   # (scorer rows: scored_by)
    assert replicas == {0, 1}   # both replicas served
    workers = json.loads((run_dir / "placement.json").read_text())["workers"]
    assert {w["worker"] for w in workers if w["role"] == "actor"} == {0, 1}      # both ranks trained
