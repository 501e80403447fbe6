"""Reward faults through the driver: one reward call in five runs past the pool's deadline, and a
batch scorer returns the wrong number of scores, NaN, inf or None. Each iteration ends in bounded
time, the failures are stored as error/timeout records (never a score) and counted, training
goes on to the end, the audit passes, and no scorer process is left behind, not even when a
scorer hangs past the driver's stage watchdog.

The scorers live at module level so pool workers can unpickle them; this module imports only
light modules at the top, so a worker importing it stays fast (heavy ones inside the tests).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest  # already imported by workers through tests.test_rewards_pool

from sealrl.rewards.base import RewardSample
from sealrl.rewards.verifiers import ArithmeticExactMatch, answer_text
from tests.harness import small_args
from tests.test_rewards_pool import child_pids

pytestmark = pytest.mark.slow   # fault drills through the driver

# The deadline under test: a scorer call on a ready worker takes milliseconds; a slow call sleeps
# 600 s. Deadlines start at dispatch, never while a replacement worker boots.
TIMEOUT_S = 5.0
ARGS = small_args("run.name=t", "run.iterations=4", "run.threads=1", "run.loggers=", "data.num_train=40",
                  "data.prompts_per_iter=3", "actor.micro_batch_size=6", "algorithm.reward_error=penalty",
                  "run.seed=0")


def slow(sample_id: str) -> bool:
    """About one training sample in five, chosen by its id (deterministic); no eval sample."""
    return not sample_id.startswith("eval/") and zlib.crc32(sample_id.encode()) % 5 == 0


def slow_one_in_five(response, ground_truth, sample_id) -> float:
    """A user reward function (reward.fn=tests.test_reward_faults:slow_one_in_five)."""
    if slow(sample_id):
        time.sleep(600)   # far past the deadline: only the pool's SIGKILL ends this call
    return float(answer_text(response) == str(ground_truth).strip())


class BadBatchScorer:
    """A batch scorer (as a reward model is): on iteration 1 it loses one score of the batch; on
    iteration 2 candidates 0, 1, 2 get NaN, inf and None."""

    name = "bad_batch"
    version = "3"

    def __call__(self, sample: RewardSample):
        iteration, candidate = sample.sample_id.split("/")[1], int(sample.sample_id.split("/")[-1])
        if iteration == "2" and candidate < 3 and not sample.sample_id.startswith("eval/"):
            return (math.nan, math.inf, None)[candidate]
        return ArithmeticExactMatch()(sample)

    def score_batch(self, samples):
        scores = [self(s) for s in samples]
        short = any(s.sample_id.split("/")[1] == "1" and not s.sample_id.startswith("eval/") for s in samples)
        return scores[:-1] if short else scores


def hangs_on_iteration_1(response, ground_truth, sample_id) -> float:
    """Never returns on iteration 1's training samples; writes its worker pid where the test looks."""
    if sample_id.split("/")[1] == "1" and not sample_id.startswith("eval/"):
        with open(os.environ["HANG_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(600)
    return float(answer_text(response) == str(ground_truth).strip())


def _train(tmp_path, monkeypatch, scorer, *extra):
    """Train with `scorer`: a reward.fn value, or a scorer object the config cannot name (a batch
    scorer), put in place of the config's."""
    from sealrl.config import build_config
    from sealrl.trainer import setup
    from sealrl.trainer.driver import train
    if isinstance(scorer, str):
        extra = (f"reward.fn={scorer}", *extra)
    else:
        monkeypatch.setattr(setup, "build_reward_fn", lambda cfg: scorer)
    return train(build_config(None, ARGS + [f"run.output_dir={tmp_path}", *extra]))


def _stored(run, it) -> list[dict]:
    from sealrl.experience.store import iteration_path, read_table
    table, _ = read_table(iteration_path(run / "experience", it))
    return table.select(["sample_id", "reward_status", "reward_total", "reward_message"]).to_pylist()


def _audit_ok(run) -> None:
    from sealrl.audit import audit_run
    report = audit_run(run)
    assert report.ok, report.summary()


def test_one_reward_call_in_five_times_out(tmp_path, monkeypatch):
    before = child_pids()
    # 6 workers: an iteration's slow calls (2 to 6 of 12 here) wait out their deadlines side by
    # side, not one after another
    # 2 iterations (6 and 2 slow calls here): each waits out one deadline
    summary = _train(tmp_path, monkeypatch, "tests.test_reward_faults:slow_one_in_five", "reward.num_scorers=6",
                     f"reward.timeout_s={TIMEOUT_S}", "run.iterations=2")
    assert child_pids() - before == set()          # every killed and every idle worker reaped
    run = tmp_path / "t"
    assert summary["completed"] and summary["iterations"] == 2
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    num_slow = 0
    for it, row in enumerate(metrics):
        stored = _stored(run, it)
        assert len(stored) == 12                    # penalty policy: every group trained
        for r in stored:
            if slow(r["sample_id"]):
                assert r["reward_status"] == "timeout" and r["reward_total"] is None
                assert f"no result within the {TIMEOUT_S:g} s deadline" in r["reward_message"]
                assert "scorer 'tests.test_reward_faults:slow_one_in_five'" in r["reward_message"]
                assert "killed" in r["reward_message"]
            else:
                assert r["reward_status"] == "ok" and r["reward_total"] is not None
        timeouts = sum(slow(r["sample_id"]) for r in stored)
        assert row["reward/status_timeout"] == timeouts and row["reward/penalised"] == timeouts
        assert sum(e["penalised"] for e in ledger if e["iteration"] == it) == timeouts
        assert row["time/reward_s"] < 300            # a call sleeps 600 s: the deadline ended it
        num_slow += timeouts
    assert len(metrics) == 2 and 0.1 <= num_slow / 24 <= 0.35   # about one call in five
    _audit_ok(run)


def test_wrong_length_nan_inf_none_become_error_records(tmp_path, monkeypatch):
    summary = _train(tmp_path, monkeypatch, BadBatchScorer(), "reward.num_scorers=0")
    run = tmp_path / "t"
    assert summary["completed"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward/errors"] for row in metrics] == [0, 12, 9, 0]
    for r in _stored(run, 1):                       # no score is matched to a sample by position
        assert r["reward_status"] == "error" and r["reward_total"] is None
        assert r["reward_message"].startswith("scorer 'bad_batch' (version 3) on sample ")
        assert r["reward_message"].endswith("score_batch returned 11 scores for 12 samples")
    expected = {0: "returned nan (float)", 1: "returned inf (float)", 2: "returned None (NoneType)"}
    for r in _stored(run, 2):
        candidate = int(r["sample_id"].split("/")[-1])
        if candidate in expected:
            assert r["reward_status"] == "error" and r["reward_total"] is None
            assert expected[candidate] in r["reward_message"], r["reward_message"]
        else:
            assert r["reward_status"] == "ok"
    _audit_ok(run)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:   # gone
        return False


def test_stage_watchdog_ends_a_hung_reward_stage_and_its_workers(tmp_path):
    # The pool's own deadline (600 s) is longer than the stage's (10 s): the watchdog ends the run.
    pids = tmp_path / "pids"
    script = ("import sys; from tests.test_reward_faults import ARGS; "
              "from sealrl.config import build_config; from sealrl.trainer.driver import train; "
              "train(build_config(None, ARGS + sys.argv[1:]))")
    # A stage's normal work here takes < 0.1 s; the hung scorer sleeps 600 s.
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script, f"run.output_dir={tmp_path}", "reward.num_scorers=2",
                          "reward.fn=tests.test_reward_faults:hangs_on_iteration_1",
                          "reward.timeout_s=600", "run.stage_timeout_s=10"], cwd=Path(__file__).parent.parent,
                         env=dict(os.environ, HANG_PIDS=str(pids)), capture_output=True, text=True, timeout=400)
    assert time.monotonic() - t0 < 300   # an orphaned worker (600 s) would hold the pipes open: TimeoutExpired
    assert out.returncode == 4, out.stderr[-1500:]
    assert "stage reward (role reward, worker pid " in out.stderr and "iteration 1," in out.stderr, out.stderr[-1500:]
    hung = [int(x) for x in pids.read_text().split()]
    assert len(hung) == 2                         # both workers were inside the scorer
    deadline = time.monotonic() + 60   # generous: the wait ends as soon as both are gone
    while any(_running(pid) for pid in hung) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in hung)


def hangs_in_evaluation(response, ground_truth, sample_id) -> float:
    """Never returns on a held-out problem (in-process: reward.num_scorers=0, the default)."""
    if sample_id.startswith("eval/"):
        time.sleep(600)
    return float(answer_text(response) == str(ground_truth).strip())


def test_a_reward_hanging_in_evaluation_is_ended_by_the_stage_deadline(tmp_path):
    script = ("import sys; from tests.test_reward_faults import ARGS; "
              "from sealrl.config import build_config; from sealrl.trainer.driver import train; "
              "train(build_config(None, ARGS + sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", script, f"run.output_dir={tmp_path}", "run.stage_timeout_s=5",
                          "reward.fn=tests.test_reward_faults:hangs_in_evaluation"], cwd=Path(__file__).parent.parent,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 4, out.stderr[-1500:]
    [failure] = [json.loads(x) for x in (tmp_path / "t" / "failures.jsonl").read_text().splitlines()]
    assert failure["stage"] == "evaluate" and failure["timeout_s"] == 5


class ExitsOrForks:
    """sys.exit() in the scorer, or a fork whose child calls sys.exit() (what a careless user
    function does); the child writes its pid first so the test can see how it ended."""

    name = "exits"
    version = "1"

    def __init__(self, pids: Path) -> None:
        self.pids = pids

    def __call__(self, sample: RewardSample):
        if sample.response == "exit":
            sys.exit(3)
        if os.fork() == 0:
            self.pids.write_text(str(os.getpid()))
            sys.exit(5)    # caught by the scorer guard, which must end this copy, not return it
        return 1.0


def test_in_process_exit_and_fork_are_contained(tmp_path):
    from sealrl.rewards.base import score_raw
    fn = ExitsOrForks(tmp_path / "child")
    [exited, forked] = score_raw(fn, [RewardSample(sample_id=f"s{i}", prompt="", response=r, response_ids=(1,),
                                                   ground_truth=None) for i, r in enumerate(("exit", "fork"))])
    assert isinstance(exited, str) and "raised SystemExit: 3" in exited      # an error record, not the end
    assert forked == (1.0, {"exits": 1.0})
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").is_file() or not (tmp_path / "child").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _, status = os.waitpid(int((tmp_path / "child").read_text()), 0)
    assert os.waitstatus_to_exitcode(status) == 0   # os._exit(0) at the guard: it never came back as a 2nd trainer
