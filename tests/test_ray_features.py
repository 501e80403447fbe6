"""Features that once stopped at placement.backend=local, on a Ray pool of 2 rollout replicas:
each gives the local run's samples and weights, and its run folder audits.

- async generation (rollout.max_staleness=1): the generation lane drives the replicas while the
  training lane publishes; each replica stages the new version beside its running generate
  (placement/rollout_pool.py) and keeps serving the retained one the lane samples from;
- LoRA: every replica pins the frozen base once and each version syncs only the adapter (with
  rollout.dtype=bf16 the base pinned in bf16);
- the KL reference in a Ray actor of its own (placement.reference=ray): the same log-probs, with
  LoRA too (the actor's base with the adapter off, copied into that actor).
"""
from __future__ import annotations

import json

import pytest

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.experience.store import read_iteration
from sealrl.trainer.driver import train

pytestmark = pytest.mark.slow   # end-to-end runs, each on a fresh local Ray

pytest.importorskip("ray", reason="placement.backend=ray needs ray (the test extra)")

ITERATIONS = 3
RAY = ["placement.backend=ray", "placement.rollout_replicas=2", "placement.num_cpus=2",
       "placement.cpus_per_replica=0.5", "placement.timeout_s=120"]
FEATURES = {
    "async": ["rollout.max_staleness=1", "algorithm.correction=token_is"],
    # the replicas pin the base in bf16 and merge each fp32 adapter into it (sync/adapter.rollout_copy);
    # fp32 LoRA on 2 replicas (and 2 ranks): tests/test_train_group.py
    "lora_bf16": ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=5e-3", "rollout.dtype=bf16",
                  "algorithm.old_log_prob=recompute"],
    # the KL reference in its own Ray actor (placement.reference=ray, on the Ray run only); one
    # thread everywhere, so that its log-probs are the driver's bit for bit
    "reference": ["algorithm.kl_coef=0.05", "run.threads=1"],
    # with LoRA the reference is the base with the adapter off: in its Ray actor, a copy of both
    "lora_reference": ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lr=5e-3", "algorithm.kl_coef=0.05",
                       "run.threads=1"],
}
RAY_ONLY = {"reference": ["placement.reference=ray"], "lora_reference": ["placement.reference=ray"]}


def _run(root, model_dir, *extra: str):   # one run name, so the two runs' sample ids compare
    cfg = build_config(None, [
        f"model.path={model_dir}", f"run.output_dir={root}", "run.name=run", f"run.iterations={ITERATIONS}",
        "run.checkpoint_every=1", "data.num_train=64", "eval.num=8", "data.prompts_per_iter=4", "rollout.n=4",
        "rollout.max_new_tokens=4", "actor.micro_batch_size=8", *extra])
    return train(cfg), root / "run"


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_feature_on_ray_replicas_gives_the_local_run_and_audits(tmp_path, tiny_model_dir, feature, shared_ray):
    local, local_dir = _run(tmp_path / "local", tiny_model_dir, *FEATURES[feature])
    remote, ray_dir = _run(tmp_path / "ray", tiny_model_dir, *FEATURES[feature], *RAY, *RAY_ONLY.get(feature, []))
    for it in range(ITERATIONS):   # the same samples, sampled by the same versions
        a = read_iteration(local_dir / "experience" / f"iter_{it:06d}.parquet")
        b = read_iteration(ray_dir / "experience" / f"iter_{it:06d}.parquet")
        assert a.sample_ids == b.sample_ids
        assert [(s.response_ids, s.policy_version) for s in a.samples] == \
               [(s.response_ids, s.policy_version) for s in b.samples]
    assert remote["policy_version"] == local["policy_version"]   # the same weights after training
    served = [json.loads(x) for x in (ray_dir / "served.jsonl").read_text().splitlines()]
    assert {k for row in served for k in row["replica_of"].values()} == {0, 1}   # both replicas served
    for run_dir in (local_dir, ray_dir):
        report = audit_run(run_dir)
        assert not report.failed_checks(), (run_dir.parent.name, report.failed_checks())
    if feature.endswith("reference"):   # it ran off the driver, and the run folder says where
        where = json.loads((ray_dir / "placement.json").read_text())
        assert ("reference", 0) in {(w["role"], w["worker"]) for w in where["workers"]}
        batch = read_iteration(ray_dir / "experience" / "iter_000000.parquet")
        assert batch.provenance("ref_log_probs")[0].value == "reference"
    if feature == "async":   # iteration i >= 1 was sampled by the version one publication behind
        consumed = [json.loads(x) for x in (ray_dir / "experience" / "consumed.jsonl").read_text().splitlines()]
        assert [c["iteration"] for c in consumed] == list(range(ITERATIONS))
        sampled = [c["sampled_by"] for c in consumed]
        assert sampled[1] == sampled[0] and sampled[2].split("#")[0] == consumed[0]["committed"], consumed


REWARD_FILE = '''
def score(response, ground_truth):   # the digits of the answer, partly right or not at all
    want, got = str(ground_truth).strip(), response.strip()
    return sum(a == b for a, b in zip(want, got)) / max(len(want), 1)
'''


def test_scorers_off_the_driver_give_the_driver_scored_run_with_no_reward_file_on_their_node(
        tmp_path, tiny_model_dir, shared_ray, monkeypatch):
    """placement.scorers=ray: the reward role and its 2 scorer processes in a Ray actor of their
    own. The reward file, named by a path relative to where the run starts, is read once on the
    driver and travels as text: it is deleted before the actor starts, and the records are still
    the driver-scored run's, record for record, and so are the weights."""
    from sealrl.placement import remote_reward
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    monkeypatch.chdir(tmp_path)
    args = ["reward.fn=my_reward.py:score", "reward.num_scorers=2", *RAY]
    local, local_dir = _run(tmp_path / "driver", tiny_model_dir, *args)
    built = remote_reward.ray_reward

    def without_the_file(*a, **k):
        (tmp_path / "my_reward.py").unlink()
        return built(*a, **k)

    monkeypatch.setattr(remote_reward, "ray_reward", without_the_file)
    remote, ray_dir = _run(tmp_path / "ray", tiny_model_dir, *args, "placement.scorers=ray")
    assert not (tmp_path / "my_reward.py").exists()
    for it in range(ITERATIONS):
        a = read_iteration(local_dir / "experience" / f"iter_{it:06d}.parquet").get("reward_records")
        b = read_iteration(ray_dir / "experience" / f"iter_{it:06d}.parquet").get("reward_records")
        assert [(r.status, r.total, r.components) for r in a] == [(r.status, r.total, r.components) for r in b]
        assert {r.status.value for r in b} == {"ok"} and len({r.total for r in b}) > 1   # scored, not one value
    assert remote["policy_version"] == local["policy_version"]
    where = json.loads((ray_dir / "placement.json").read_text())
    assert ("reward", 0) in {(w["role"], w["worker"]) for w in where["workers"]}
    assert not audit_run(ray_dir).failed_checks()
