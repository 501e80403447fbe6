"""Exact resume of an asynchronous run (trainer/resume/retained.py): a k >= 1 run killed at any stage of
the pipeline and resumed with run.resume=auto gives bitwise the weights of the run never
interrupted, trains the same prompts per iteration with nothing lost or doubled (audit), and
does not write twice the experience it had sealed before the crash. A replay from the schedule
in the sealed records (trainer/offline/replay.py) reproduces a k = 1 and a k = 2 run bitwise, and
names the iteration of a record whose schedule was edited."""
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sealrl import faults
from sealrl.audit import audit_run
from sealrl.cli import main
from sealrl.experience.store import read_iteration
from sealrl.trainer import driver as driver_module
from sealrl.trainer import pipeline as pipeline_module
from sealrl.trainer.offline.replay import ReplayMismatch, ScheduleError, recorded_schedule, replay
from tests.test_audit import _iter, _reseal, _rewrite
from tests.test_pipeline import _numbers, _train

ITERATIONS = 5   # checkpoints at 2 and 4 (run.checkpoint_every=2); the crashes hit iteration 3


def _extra(k: int) -> tuple[str, ...]:
    """REINFORCE++ (a batch baseline): with this seed iterations 0, 2, 3 and 4 all have signal
    (nonzero gradients), so a sample drawn from another version changes the weights. (GRPO's
    groups here have zero variance until iteration 4: every schedule would give one hash.)"""
    return (f"rollout.max_staleness={k}", "algorithm.correction=token_is", f"run.iterations={ITERATIONS}",
            "algorithm.name=reinforce_pp")


# variant -> (k, its overrides); with LoRA the retained versions are adapters on the pinned base;
# with the process lane the resumed run loads them into the generation process
VARIANTS = {"k1": (1, _extra(1)), "k2": (2, _extra(2)), "k1_lora": (1, _extra(1) + ("actor.lora.rank=4",)),
            "k1_process": (1, _extra(1) + ("rollout.lane=process",))}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The runs never interrupted, by variant."""
    out = tmp_path_factory.mktemp("whole")
    return {v: _train(out / v, "exact", *extra) for v, (_, extra) in VARIANTS.items()}


def _on_call(n: int, real, after: bool = False):
    """`real`, raising at its n-th call (before calling it, or after when `after`)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n and not after:
            raise RuntimeError(f"injected crash at call {n}")
        out = real(*args, **kwargs)
        if len(calls) == n:
            raise RuntimeError(f"injected crash after call {n}")
        return out
    return wrapped


def _checkpoint_write_crash(real):
    def point(stage, iteration):
        if stage == "checkpoint_before_marker" and iteration == 4:   # files written, no marker yet
            raise RuntimeError("injected crash while writing checkpoint 4")
        return real(stage, iteration)
    return point


# stage -> (module, attribute, wrapper): each crashes during iteration 3 (the 4th call), so the
# resume starts from checkpoint 2 with the generation lane one or two iterations ahead
STAGES = {
    "generate": (pipeline_module, "generate", lambda f: _on_call(4, f)),
    "reward": (pipeline_module, "decode_and_score", lambda f: _on_call(4, f)),
    "prepare": (driver_module, "prepare", lambda f: _on_call(4, f)),
    "seal": (driver_module, "seal", lambda f: _on_call(4, f, after=True)),   # sealed, never consumed
    "update": (driver_module, "update", lambda f: _on_call(4, f)),
    "publish": (driver_module, "publish", lambda f: _on_call(5, f)),          # 1st call: the run's start
    "checkpoint": (faults, "point", _checkpoint_write_crash),
}


def _ledger(run: Path) -> list[tuple]:
    return [(x["iteration"], x["prompt_id"], x["status"]) for x in map(json.loads, (run / "ledger.jsonl").open())]


def _sealed(run: Path) -> list[str]:
    return [read_iteration(p).seal_digest for p in sorted((run / "experience").glob("iter_*.parquet"))]


def _consumed(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "experience" / "consumed.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("variant, stage", [("k1", s) for s in STAGES] + [("k2", "update"), ("k2", "generate"),
                                                                           ("k1_lora", "update"),
                                                                           ("k1_process", "update")])
def test_killed_at_each_stage_resumes_to_the_uninterrupted_weights(whole, tmp_path, monkeypatch, variant, stage):
    k, extra = VARIANTS[variant]
    module, name, wrap = STAGES[stage]
    real = getattr(module, name)
    monkeypatch.setattr(module, name, wrap(real))
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "exact", *extra)
    monkeypatch.setattr(module, name, real)
    run = tmp_path / "exact"
    assert (run / "checkpoints" / "latest").read_text() == "step_2"
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert sorted(state["lane"]["versions"]) == [str(j) for j in range(2 - k, 2)]   # what samples 2 .. 2+k-1
    assert len(state["lane"]["weights"]) == k                                       # none is the actor's own
    sealed3 = run / "experience" / "iter_000003.parquet"
    before = sealed3.stat() if sealed3.exists() else None
    assert (before is not None) == (stage in ("seal", "update", "publish", "checkpoint"))

    summary, run = _train(tmp_path, "exact", *extra, "run.resume=auto")
    want, whole_run = whole[variant]
    assert summary["completed"] and summary["optimizer_steps"] == ITERATIONS
    assert summary["weights_hash"] == want["weights_hash"]          # bitwise the run never interrupted
    report = audit_run(run)
    assert report.ok, report.summary()
    assert report.num_iterations == ITERATIONS and report.num_samples == ITERATIONS * 16
    assert _ledger(run) == _ledger(whole_run)                      # same prompts per iteration, once each
    assert _sealed(run) == _sealed(whole_run)
    assert _consumed(run) == _consumed(whole_run)                  # same schedule: who sampled, who consumed
    assert _numbers(run) == _numbers(whole_run)                    # metrics (staleness too), timings aside
    if before is not None:   # sealed before the crash: the resumed run did not write it again
        after = sealed3.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_sealed_file_that_differs_from_the_resumed_run_is_replaced_and_said(whole, tmp_path, monkeypatch, capfd):
    """Killed right after sealing iteration 3, whose file is then damaged: the resumed run cannot
    reuse it, says so, and writes its own (the run still ends on the uninterrupted weights)."""
    module, name, wrap = STAGES["seal"]
    real = getattr(module, name)
    monkeypatch.setattr(module, name, wrap(real))
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "exact", *_extra(1))
    monkeypatch.setattr(module, name, real)
    sealed3 = tmp_path / "exact" / "experience" / "iter_000003.parquet"
    sealed3.write_bytes(sealed3.read_bytes()[:100])
    capfd.readouterr()
    summary, run = _train(tmp_path, "exact", *_extra(1), "run.resume=auto")
    assert f"{sealed3} (sealed before the resume) cannot be read" in capfd.readouterr().err
    assert summary["weights_hash"] == whole["k1"][0]["weights_hash"]
    assert _sealed(run) == _sealed(whole["k1"][1]) and audit_run(run).ok


def test_uninterrupted_runs_follow_the_fixed_lag(whole):
    """What the resumed runs are compared with: iteration i sampled by the version of step max(0, i - k)."""
    for variant, (_, run) in whole.items():
        k = VARIANTS[variant][0]
        steps = [int(c["sampled_by"].split("@")[1].split(".")[0]) for c in _consumed(run)]
        assert steps == [max(0, i - k) for i in range(ITERATIONS)]
        norms = [json.loads(x)["actor/grad_norm"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [n > 0 for n in norms[2:]] == [True] * (ITERATIONS - 2)   # the resumed iterations all learn


# ---- replay from the recorded schedule --------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2])
def test_replay_of_an_async_run_reproduces_its_weights_bitwise(whole, tmp_path, k):
    want, run = whole[f"k{k}"]
    result = replay(run, tmp_path / "replay")
    assert result["lag"] == [min(i, k) for i in range(ITERATIONS)]   # read from the sealed records
    assert result["weights_hash"] == want["weights_hash"] and result["bitwise"]
    assert _sealed(Path(result["replay_dir"])) == _sealed(run)


def _forge(path: Path, version_id: str, version_json: str) -> None:
    """Re-stamp every sample of the record at `path` as sampled by `version_id` and re-seal it,
    as a forger with the code would: the seal no longer tells, only the schedule does."""
    now = pq.read_table(path).column("policy_version")[0].as_py()

    def meta(m):
        m["versions"] = {version_id: version_json}
        for f in m["fields"].values():
            f["version"] = version_id if f["version"] == now else f["version"]
    _rewrite(path, lambda c: c.update(policy_version=[version_id] * len(c["policy_version"])), meta)
    _reseal(path)


def _version_of(run: Path, i: int) -> tuple[str, str]:
    """(id, JSON) of the version that sampled iteration i."""
    table = pq.read_table(_iter(run, i))
    vid = table.column("policy_version")[0].as_py()
    return vid, json.loads(table.schema.metadata[b"sealrl"])["versions"][vid]


def test_replay_reports_a_record_whose_schedule_was_edited(whole, tmp_path):
    """Iteration 3 of the k = 1 run re-stamped as sampled by the version consuming it (step 3,
    the one that sampled iteration 4): a schedule the pipeline can follow (lag 0), but not the
    one that produced the record's tokens; replay says where."""
    run = Path(shutil.copytree(whole["k1"][1], tmp_path / "edited"))
    _forge(_iter(run, 3), *_version_of(run, 4))
    assert recorded_schedule(run, ITERATIONS, 1) == {0: 0, 1: 0, 2: 1, 3: 3, 4: 3}
    with pytest.raises(ReplayMismatch, match="iteration 3: the replay sealed other facts"):
        replay(run, tmp_path / "replay")


@pytest.mark.parametrize("iteration, by, why", [
    (1, 4, "which no update up to iteration 1 started from"),   # a version from the future
    (4, 0, "beyond rollout.max_staleness=1"),                    # older than the rollout retains
])
def test_replay_refuses_a_schedule_it_cannot_follow(whole, tmp_path, iteration, by, why):
    run = Path(shutil.copytree(whole["k1"][1], tmp_path / "edited"))
    _forge(_iter(run, iteration), *_version_of(run, by))
    with pytest.raises(ScheduleError, match=f"iteration {iteration}: .*{why}"):
        replay(run, tmp_path / "replay")
    assert not (tmp_path / "replay").exists()   # refused before training anything
    assert main(["replay", str(run), "--out", str(tmp_path / "replay")]) == 2   # `sealrl: error: ...`
