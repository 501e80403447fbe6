"""Injected faults at every named stage: killed runs resume to the same final weights as an
uninterrupted run (bitwise), failed stages recover (regenerate, roll back and retry), and
corrupted weight syncs are refused naming the tensor."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from sealrl.audit import audit_run
from sealrl.trainer.config import build_config
from sealrl.trainer.driver import train

ARGS = ["run.name=f", "run.iterations=4", "run.progress=false", "run.checkpoint_every=1", "run.threads=1",
        "data.num_train=40", "eval.num=4", "data.prompts_per_iter=3", "rollout.n=4", "rollout.max_new_tokens=5",
        "actor.micro_batch_size=6", "actor.lr=1e-3", "algorithm.kl_coef=0.05", "actor.mini_batch_size=6"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(build_config(None, ARGS + [f"run.output_dir={out}"]))
    return out / "f"


def _same_final(a, b):
    for part in ("actor_model", "actor_optim"):
        x = load_file(str(a / "checkpoints" / "step_4" / f"{part}.safetensors"))
        y = load_file(str(b / "checkpoints" / "step_4" / f"{part}.safetensors"))
        assert all(x[k].equal(y[k]) for k in x), part


def _cli(tmp_path, faults, *extra):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    env = dict(os.environ, SEALRL_FAULTS=faults)
    return subprocess.run([sys.executable, "-m", "sealrl.cli", "train", str(cfg), *ARGS, f"run.output_dir={tmp_path}",
                           *extra], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("stage", ["rollout@2", "reward@2", "reference@2", "old_log_prob@2", "actor_update@2",
                                   "before_optimizer_step@2", "weight_sync@2", "checkpoint_before_marker@2",
                                   "checkpoint_after_marker@2", "after_checkpoint@2"])
def test_kill_at_stage_then_resume_equals_straight_run(tmp_path, straight, stage):
    killed = _cli(tmp_path, f"{stage}:kill")
    assert killed.returncode == -9, killed.stderr[-1500:]
    train(build_config(None, ARGS + [f"run.output_dir={tmp_path}", "run.resume=auto"]))   # in-process: faster
    _same_final(straight, tmp_path / "f")
    ledger = [json.loads(x) for x in (tmp_path / "f" / "ledger.jsonl").read_text().splitlines()]
    assert sorted(e["iteration"] for e in ledger) == sorted(list(range(4)) * 3)   # nothing duplicated
    report = audit_run(tmp_path / "f")
    assert report.ok, report.summary()


def test_failed_rollout_and_update_recover_in_place(tmp_path, straight):
    os.environ["SEALRL_FAULTS"] = "rollout@1:raise,before_optimizer_step@2:raise,reward@3:raise"
    try:
        train(build_config(None, ARGS + [f"run.output_dir={tmp_path}", "algorithm.reward_error=retry"]))
    finally:
        del os.environ["SEALRL_FAULTS"]
    rows = [json.loads(x) for x in (tmp_path / "f" / "metrics.jsonl").read_text().splitlines()]
    assert rows[1]["rollout/failed_calls"] == 1 and rows[1]["groups/regenerated_samples"] == 12
    assert rows[2]["update/attempts"] == 2
    assert rows[3]["reward/errors"] == 12 and rows[3]["groups/dropped"] == 0   # re-scored on retry
    _same_final(straight, tmp_path / "f")   # same seeds, rolled-back state: same weights
    report = audit_run(tmp_path / "f")
    assert report.ok, report.summary()


def test_corrupted_weight_sync_is_refused_naming_the_tensor(tmp_path):
    out = _cli(tmp_path, "weight_sync@2:corrupt")
    assert out.returncode == 2
    assert "sealrl: error:" in out.stderr and "model.embed_tokens.weight" in out.stderr, out.stderr[-800:]
    assert (tmp_path / "f" / "checkpoints" / "latest").read_text() == "step_1"
