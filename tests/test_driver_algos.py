"""Every algorithm and option the config offers runs through the driver, records the right
fields with the right producers, and produces finite metrics (warm-start model, seconds)."""
import json
import math

import pytest

from sealrl.audit import audit_run
from sealrl.experience.store import read_iteration, read_table
from sealrl.config import build_config
from sealrl.trainer.driver import train

BASE = ["run.iterations=2", "run.progress=false", "data.num_train=48", "eval.num=8",
        "data.prompts_per_iter=4", "rollout.n=4", "rollout.max_new_tokens=5", "actor.micro_batch_size=6",
        "actor.lr=1e-3", "run.seed=1"]

CASES = {
    "grpo": [],
    "dr_grpo": ["algorithm.name=dr_grpo", "actor.loss_agg=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.name=rloo", "actor.loss_agg=seq-mean-token-mean"],
    "reinforce_pp": ["algorithm.name=reinforce_pp", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward"],
    "reinforce_pp_baseline": ["algorithm.name=reinforce_pp_baseline", "algorithm.kl_coef=0.05",
                              "algorithm.kl_in=reward", "algorithm.kl_estimator=k2"],
    "ppo": ["algorithm.name=ppo", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward", "critic.value_clip=0.2",
            "actor.ppo_epochs=2", "actor.mini_batch_size=8"],
    "grpo_kl_loss": ["algorithm.kl_coef=0.1", "algorithm.kl_in=loss", "algorithm.kl_estimator=k3+",
                     "algorithm.kl_target=0.01"],
    "bypass_token_is": ["algorithm.old_log_prob=bypass", "algorithm.correction=token_is"],
    "seq_reject": ["algorithm.correction=seq_reject", "algorithm.correction_threshold=0.5"],
    "overlong_soft": ["algorithm.overlong=soft", "algorithm.overlong_buffer=2", "rollout.max_new_tokens=4"],
    "overlong_mask": ["algorithm.overlong=mask", "rollout.max_new_tokens=4"],
    "clip_higher_entropy_dual": ["actor.clip_high=0.28", "actor.entropy_coef=0.01", "actor.dual_clip=3.0",
                                 "actor.lr_schedule=cosine", "actor.warmup_steps=1"],
    "gspo": ["actor.loss=gspo", "actor.clip_low=3e-4", "actor.clip_high=4e-4", "actor.loss_agg=seq-mean-token-mean"],
    "pg_top_k": ["actor.loss=pg", "rollout.top_k=5", "rollout.top_p=0.9"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_algorithm_runs_and_records_provenance(tmp_path, name):
    cfg = build_config(None, BASE + CASES[name] + [f"run.output_dir={tmp_path}", f"run.name={name}"])
    summary = train(cfg)
    run = tmp_path / name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and summary["iterations"] == 2
    for row in rows:
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
    batch = read_iteration(run / "experience" / "iter_000001.parquet")
    _, meta = read_table(run / "experience" / "iter_000001.parquet")
    fields = meta["fields"]
    old_producer = "rollout" if cfg.algorithm.old_log_prob == "bypass" else "actor"
    assert fields["old_log_probs"]["producer"] == old_producer
    assert fields["old_log_probs"]["version"] == batch.samples[0].policy_version
    assert ("ref_log_probs" in fields) == (cfg.algorithm.kl_coef > 0)   # no reference model when beta = 0
    if "ref_log_probs" in fields:
        assert fields["ref_log_probs"]["producer"] == "reference"
        assert fields["ref_log_probs"]["version"].startswith("reference@0.0#")
    assert ("values" in fields) == ("returns" in fields) == (cfg.algorithm.name == "ppo")
    assert ("filtered_log_probs" in fields) == (cfg.rollout.top_k > 0)
    assert rows[1]["actor/lr"] > 0 and rows[0]["groups/committed"] == 4
    report = audit_run(run)
    assert report.ok, report.summary()
