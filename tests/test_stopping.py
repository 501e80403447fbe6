"""Stops and damage an operator meets: SIGTERM / SIGINT end at a checkpoint with a named status, a
finished run stays `completed`, a torn log line or trace does not block a resume, a full disk
leaves nothing partial, and a corrupted or unpointed latest checkpoint falls back to the newest
intact one. Every resume here is checked against the run never interrupted, bitwise."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from sealrl import faults
from sealrl.cli import main
from sealrl.obs.timeline import StageTimer
from sealrl.trainer.resume.checkpoint import CheckpointError, prune_checkpoints, resume_checkpoint, save_checkpoint
from sealrl.trainer.resume.position import forget_after
from tests.test_pipeline import BASE


def _cli(tmp_path: Path, out: str, *extra: str, faults_plan: str = "", monkeypatch=None) -> tuple[int, dict]:
    """`sealrl train` in this process (its signal handlers are the main thread's); returns the exit
    status and summary.json (empty when none was written)."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    monkeypatch.setenv("SEALRL_FAULTS", faults_plan)
    faults._fired.clear()
    base = [o for o in BASE if not o.startswith("run.checkpoint_every=")]
    status = main(["train", str(empty), *base, "run.checkpoint_every=1", f"run.output_dir={tmp_path / out}",
                   "run.name=r", *extra])
    summary = tmp_path / out / "r" / "summary.json"
    return status, (json.loads(summary.read_text()) if summary.is_file() else {})


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    with pytest.MonkeyPatch.context() as mp:
        status, summary = _cli(tmp, "a", monkeypatch=mp)
    assert status == 0 and summary["completed"] and summary["iterations"] == 4
    return summary["weights_hash"]


@pytest.mark.slow
def test_sigterm_finishes_the_iteration_commits_a_checkpoint_and_resumes_exactly(tmp_path, monkeypatch, straight,
                                                                                  capsys):
    status, summary = _cli(tmp_path, "b", faults_plan="update@1:term", monkeypatch=monkeypatch)
    run = tmp_path / "b" / "r"
    assert status == 143 and "stopped by SIGTERM after 2 of 4 iterations" in capsys.readouterr().err
    assert summary["stopped_by"] == "SIGTERM" and not summary["completed"] and summary["iterations"] == 2
    assert (run / "checkpoints" / "latest").read_text() == "step_2"
    status, summary = _cli(tmp_path, "b", "run.resume=auto", monkeypatch=monkeypatch)
    assert status == 0 and summary["completed"] and summary["iterations"] == 4
    assert summary["weights_hash"] == straight
    # resuming a finished run (a supervisor that restarts until `completed`) changes nothing
    status, again = _cli(tmp_path, "b", "run.resume=auto", monkeypatch=monkeypatch)
    assert status == 0 and again["completed"] and again["iterations"] == 4 and again["weights_hash"] == straight
    assert "wall cap" not in capsys.readouterr().err


@pytest.mark.slow
def test_second_signal_abandons_the_iteration_and_the_last_checkpoint_resumes_exactly(tmp_path, monkeypatch,
                                                                                     straight, capsys):
    status, summary = _cli(tmp_path, "c", faults_plan="generate@2:int,update@2:int", monkeypatch=monkeypatch)
    run = tmp_path / "c" / "r"
    assert status == 130 and summary == {} and "interrupted" in capsys.readouterr().err
    assert (run / "checkpoints" / "latest").read_text() == "step_2"   # iteration 2 abandoned
    status, summary = _cli(tmp_path, "c", "run.resume=auto", monkeypatch=monkeypatch)
    assert status == 0 and summary["weights_hash"] == straight


@pytest.mark.slow
def test_torn_logs_corrupt_latest_and_lost_pointer_still_resume_exactly(tmp_path, monkeypatch, straight, capsys):
    _cli(tmp_path, "d", faults_plan="after_checkpoint@3:raise", monkeypatch=monkeypatch)
    run = tmp_path / "d" / "r"
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_3"
    for name in ("metrics.jsonl", "ledger.jsonl", "experience/consumed.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"iteration": 3, "half a li')          # what a crash mid-append leaves
    (run / "trace.json").write_text((run / "trace.json").read_text()[:100])
    (ckpts / "step_3" / "state.json").write_text("{}")      # the latest checkpoint corrupted
    capsys.readouterr()
    status, summary = _cli(tmp_path, "d", "run.resume=auto", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert status == 0 and summary["weights_hash"] == straight, err[-2000:]
    assert "resuming from step_2, the newest intact checkpoint" in err and "last line is torn" in err
    assert list(run.glob("trace.json.unreadable-*"))
    # the pointer deleted: the newest committed checkpoint, said; never a silent restart
    (ckpts / "latest").unlink()
    status, summary = _cli(tmp_path, "d", "run.resume=auto", monkeypatch=monkeypatch)
    assert status == 0 and summary["weights_hash"] == straight and summary["iterations"] == 4
    assert "latest is missing; resuming from step_4" in capsys.readouterr().err


def test_a_damaged_line_before_the_end_is_refused_naming_it(tmp_path):
    (tmp_path / "ledger.jsonl").write_text('{"iteration": 0}\nnot json\n{"iteration": 1}\n')
    with pytest.raises(CheckpointError, match="ledger.jsonl: line 2"):
        forget_after(tmp_path, 1)


def test_a_torn_trace_is_set_aside(tmp_path, capsys):
    (tmp_path / "trace.json").write_text('{"traceEvents": [{"name": "gen')
    timer = StageTimer(tmp_path / "trace.json")
    timer.mark("GENERATING", "v")
    timer.flush()
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"][0]["name"] == "GENERATING"
    assert "set aside" in capsys.readouterr().err


def test_a_full_disk_during_a_checkpoint_leaves_nothing_partial(tmp_path):
    save_checkpoint(tmp_path, 1, {}, {"iteration": 1})

    def full(folder: Path):
        folder.mkdir()
        (folder / "part").write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "part"))

    with pytest.raises(CheckpointError, match="step_2 .*No space left.*previous checkpoint step_1 is intact"):
        save_checkpoint(tmp_path, 2, {}, {"iteration": 2}, {"model": full})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]


def test_pruning_keeps_the_newest_and_the_latest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {}, {"iteration": step})
    assert prune_checkpoints(tmp_path, 0) == []
    assert sorted(prune_checkpoints(tmp_path, 2)) == ["step_1", "step_2", "step_3"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_4", "step_5"]
    assert resume_checkpoint(tmp_path).name == "step_5"


def test_no_intact_checkpoint_is_one_error(tmp_path):
    save_checkpoint(tmp_path, 1, {}, {"iteration": 1})
    (tmp_path / "step_1" / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no earlier checkpoint .* is intact"):
        resume_checkpoint(tmp_path)


def always_raises(response, ground_truth) -> float:
    raise RuntimeError("the reward service is down: connection refused on port 8080 " + "x" * 80)


def test_an_iteration_whose_groups_all_dropped_is_in_the_ledger_with_whole_reasons(tmp_path, monkeypatch, capsys):
    status, _ = _cli(tmp_path, "e", "reward.fn=tests.test_stopping:always_raises", "algorithm.reward_error=drop_group",
                     monkeypatch=monkeypatch)
    assert status == 2 and "every group was dropped" in capsys.readouterr().err
    rows = [json.loads(x) for x in (tmp_path / "e" / "r" / "ledger.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["status"] == "dropped" and r["iteration"] == 0 for r in rows)
    assert all("connection refused on port 8080" in r["reason"] for r in rows)   # not cut at 120 characters
    # the quarantine keeps what each dropped group held and what its scorer received and said
    [q0, *_] = quarantined = [json.loads(x) for x in
                              (tmp_path / "e" / "r" / "quarantine" / "iter_000000.jsonl").read_text().splitlines()]
    assert [q["group_id"] for q in quarantined] == [r["group_id"] for r in rows]
    assert len(q0["samples"]) == 4 and q0["prompt"] and q0["ground_truth"] is not None
    s0 = q0["samples"][0]
    assert s0["response_ids"] and s0["reward"]["status"] == "error" and "connection refused" in s0["reward"]["message"]
    from sealrl.obs.report import _quarantine_table  # the report's section (this run has no metrics to plot)
    html = _quarantine_table(tmp_path / "e" / "r")
    assert "4 dropped groups" in html and "connection refused" in html


def test_command_line_mistakes_are_one_line(tmp_path, monkeypatch, capsys):
    status, _ = _cli(tmp_path, "f", "algorithm.kl_coef=0.1", "algorithm.kl_coef=0.2", monkeypatch=monkeypatch)
    assert status == 2
    assert "override algorithm.kl_coef is given twice (algorithm.kl_coef=0.1 and algorithm.kl_coef=0.2)" in \
        capsys.readouterr().err
    status, _ = _cli(tmp_path, "f", "model.path=", monkeypatch=monkeypatch)
    assert status == 2 and "model.path is empty" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_during_an_append_is_one_line_and_resume_is_exact(tmp_path, monkeypatch, straight, capsys):
    from sealrl.trainer import prepare
    real, calls = prepare.append_lines, []

    def full_disk(path, rows):   # the ledger append of iteration 2: half a line written, then ENOSPC
        calls.append(path)
        if Path(path).name == "ledger.jsonl" and rows and rows[0]["iteration"] == 2:
            with open(path, "a") as f:
                f.write('{"iteration": 2, "gro')
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, rows)

    monkeypatch.setattr(prepare, "append_lines", full_disk)
    status, summary = _cli(tmp_path, "g", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and summary == {} and "disk full writing" in err and "ledger.jsonl" in err
    assert "Traceback" not in err
    monkeypatch.setattr(prepare, "append_lines", real)
    status, summary = _cli(tmp_path, "g", "run.resume=auto", monkeypatch=monkeypatch)
    assert status == 0 and summary["weights_hash"] == straight and "last line is torn" in capsys.readouterr().err
