"""Injected faults at every named stage: killed runs resume to the same final weights as an
uninterrupted run (bitwise), failed stages recover (regenerate, roll back and retry), hung
stages end the process naming the stage and resume exactly, duplicate and late deliveries are
refused by key and counted, and corrupted weight syncs are refused naming the tensor."""
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.experience.store import iteration_path, read_table
from sealrl.trainer.driver import train
from tests.harness import small_args

ARGS = small_args("run.name=f", "run.iterations=4", "run.checkpoint_every=1", "run.threads=1", "data.num_train=40",
                  "data.prompts_per_iter=3", "actor.micro_batch_size=6", "algorithm.kl_coef=0.05",
                  "actor.mini_batch_size=6", "run.seed=0")


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


def _cli(tmp_path, faults, *extra, timeout=300, env=None):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    env = dict(env or os.environ, SEALRL_FAULTS=faults)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "sealrl.cli", "train", str(cfg), *ARGS, f"run.output_dir={tmp_path}",
                          *extra], env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


KILLED = ["generate@2", "reward@2", "reference@2", "old_log_prob@2", "update@2", "before_optimizer_step@2",
          "weight_sync@2", "checkpoint_before_marker@2", "checkpoint_after_marker@2", "after_checkpoint@2"]
# (fault, the stage the watchdog names, its iteration): checkpoint faults count the checkpoint's step
HUNG = [("generate@2", "stage generate (role rollout", 2), ("before_optimizer_step@2", "stage update (role actor", 2),
        ("checkpoint_after_marker@2", "stage checkpoint (role driver", 1)]
# The deadline under test: a stage's normal work takes < 0.1 s here (a cold first stage in a fresh
# process well under 1 s, even on a loaded machine); a hung stage never returns.
STAGE_TIMEOUT_S = 15


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every CLI run of this module (a new interpreter each: ~4 s of imports, then a few tenths
    of a second of training, or a wait for the watchdog) starts up front, in the background,
    while the tests resume and compare in this process: the 3 hung runs at once (they mostly
    wait for the watchdog), the others 2 at a time. Each test takes its run's folder,
    CompletedProcess and seconds."""
    env = dict(os.environ)   # copied here: tests below set SEALRL_FAULTS in this process meanwhile
    hung, others = ThreadPoolExecutor(max_workers=len(HUNG)), ThreadPoolExecutor(max_workers=2)
    runs = {("hang", stage): (hung, f"{stage}:hang", f"run.stage_timeout_s={STAGE_TIMEOUT_S}") for stage, _, _ in HUNG}
    runs.update({("kill", stage): (others, f"{stage}:kill") for stage in KILLED})
    runs[("corrupt", "weight_sync@2")] = (others, "weight_sync@2:corrupt")
    started = {}
    for key, (pool, faults, *extra) in runs.items():
        out = tmp_path_factory.mktemp(f"{key[0]}_{key[1].replace('@', '_')}")
        started[key] = out, pool.submit(_cli, out, faults, *extra, env=env, timeout=600 if pool is hung else 300)
    yield lambda kind, stage: (started[(kind, stage)][0], *started[(kind, stage)][1].result())
    for pool in (hung, others):   # every run is bounded by its subprocess timeout
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", KILLED)
def test_kill_at_stage_then_resume_equals_straight_run(cli_runs, straight, stage):
    tmp_path, killed, _ = cli_runs("kill", stage)
    assert killed.returncode == -9, killed.stderr[-1500:]
    train(build_config(None, ARGS + [f"run.output_dir={tmp_path}", "run.resume=auto"]))   # in-process: faster
    _same_final(straight, tmp_path / "f")
    ledger = [json.loads(x) for x in (tmp_path / "f" / "ledger.jsonl").read_text().splitlines()]
    assert sorted(e["iteration"] for e in ledger) == sorted(list(range(4)) * 3)   # nothing duplicated
    report = audit_run(tmp_path / "f")
    assert report.ok, report.summary()


@pytest.mark.slow
def test_failed_rollout_and_update_recover_in_place(tmp_path, straight):
    os.environ["SEALRL_FAULTS"] = "generate@1:raise,before_optimizer_step@2:raise,reward@3:raise"
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


@pytest.mark.slow
def test_corrupted_weight_sync_is_refused_naming_the_tensor(cli_runs):
    tmp_path, out, _ = cli_runs("corrupt", "weight_sync@2")
    assert out.returncode == 2
    assert "sealrl: error:" in out.stderr and "model.embed_tokens.weight" in out.stderr, out.stderr[-800:]
    assert (tmp_path / "f" / "checkpoints" / "latest").read_text() == "step_1"


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("stage, named, it", HUNG)
def test_hung_stage_exits_naming_it_then_resume_equals_straight_run(cli_runs, straight, stage, named, it):
    tmp_path, hung, seconds = cli_runs("hang", stage)
    assert seconds < 300                          # the hang itself would never end (the run's timeout: 600 s)
    assert hung.returncode == 4, hung.stderr[-1500:]
    assert f"{named}, worker pid " in hung.stderr and f"iteration {it}," in hung.stderr, hung.stderr[-1500:]
    [failure] = [json.loads(x) for x in (tmp_path / "f" / "failures.jsonl").read_text().splitlines()]
    assert failure["stage"] == named.split()[1] and failure["iteration"] == it
    assert failure["timeout_s"] == STAGE_TIMEOUT_S
    train(build_config(None, ARGS + [f"run.output_dir={tmp_path}", "run.resume=auto"]))
    _same_final(straight, tmp_path / "f")
    report = audit_run(tmp_path / "f")
    assert report.ok, report.summary()


@pytest.mark.slow
def test_duplicate_and_late_deliveries_are_refused_by_key_and_counted(tmp_path, straight):
    # generate@2:late: the first generate call "misses its deadline" and is regenerated (same seeds);
    # its samples, identical to the regenerated ones, arrive afterwards and are still refused.
    # reward@3:late: the first scoring call times out, the retry policy re-scores, then the first
    # call's records arrive.
    os.environ["SEALRL_FAULTS"] = "generate@1:twice,reward@1:twice,generate@2:late,reward@3:late"
    try:
        train(build_config(None, ARGS + [f"run.output_dir={tmp_path}", "algorithm.reward_error=retry"]))
    finally:
        del os.environ["SEALRL_FAULTS"]
    rows = _metrics(tmp_path / "f")
    refused = [{k: r[k] for k in ("rollout/duplicate_deliveries", "rollout/late_deliveries",
                                  "reward/duplicate_deliveries", "reward/late_deliveries")} for r in rows]
    assert [tuple(r.values()) for r in refused] == [(0, 0, 0, 0), (12, 0, 12, 0), (0, 12, 0, 0), (0, 0, 0, 12)]
    assert rows[2]["rollout/failed_calls"] == 1 and rows[2]["groups/regenerated_samples"] == 12
    assert rows[3]["reward/errors"] == 12 and rows[3]["groups/dropped"] == 0
    assert all(r["groups/committed"] == 3 for r in rows)
    for it in range(4):   # nothing duplicated in the stored experience, every record the accepted one
        table, _ = read_table(iteration_path(tmp_path / "f" / "experience", it))
        ids = table.column("sample_id").to_pylist()
        assert len(ids) == len(set(ids)) == 12
        assert set(table.column("reward_status").to_pylist()) == {"ok"}
    _same_final(straight, tmp_path / "f")
    report = audit_run(tmp_path / "f")
    assert report.ok, report.summary()


def test_unknown_and_misplaced_fault_actions_are_refused(monkeypatch):
    from sealrl import faults
    for plan, words in (("generate@1:vanish", "hang | delay=SECONDS"), ("reference@1:twice", "only at stage generate")):
        monkeypatch.setenv("SEALRL_FAULTS", plan)
        with pytest.raises(ValueError, match=re.escape(words)):
            faults.point("generate", 1)
