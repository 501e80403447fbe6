"""Exact resume of an asynchronous run (trainer/retained.py): a k >= 1 run killed at any stage of
the pipeline and resumed with run.resume=auto gives bitwise the weights of the run never
interrupted, trains the same prompts per iteration with nothing lost or doubled (audit), and
does not write twice the experience it had sealed before the crash."""
import json
from pathlib import Path

import pytest

from sealrl import faults
from sealrl.audit import audit_run
from sealrl.experience.store import read_iteration
from sealrl.trainer import driver as driver_module
from sealrl.trainer import pipeline as pipeline_module
from tests.test_pipeline import _train

ITERATIONS = 5   # checkpoints at 2 and 4 (run.checkpoint_every=2); the crashes hit iteration 3


def _extra(k: int) -> tuple[str, ...]:
    """REINFORCE++ (a batch baseline): with this seed iterations 0, 2, 3 and 4 all have signal
    (nonzero gradients), so a sample drawn from another version changes the weights. (GRPO's
    groups here have zero variance until iteration 4: every schedule would give one hash.)"""
    return (f"rollout.max_staleness={k}", "algorithm.correction=token_is", f"run.iterations={ITERATIONS}",
            "algorithm.name=reinforce_pp")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The runs never interrupted, by k."""
    out = tmp_path_factory.mktemp("whole")
    return {k: _train(out / f"k{k}", "exact", *_extra(k)) for k in (1, 2)}


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


@pytest.mark.parametrize("k, stage", [(1, s) for s in STAGES] + [(2, "update"), (2, "generate")])
def test_killed_at_each_stage_resumes_to_the_uninterrupted_weights(whole, tmp_path, monkeypatch, k, stage):
    module, name, wrap = STAGES[stage]
    real = getattr(module, name)
    monkeypatch.setattr(module, name, wrap(real))
    with pytest.raises(RuntimeError, match="injected crash"):
        _train(tmp_path, "exact", *_extra(k))
    monkeypatch.setattr(module, name, real)
    run = tmp_path / "exact"
    assert (run / "checkpoints" / "latest").read_text() == "step_2"
    state = json.loads((run / "checkpoints" / "step_2" / "state.json").read_text())
    assert sorted(state["lane"]["versions"]) == [str(j) for j in range(2 - k, 2)]   # what samples 2 .. 2+k-1
    assert len(state["lane"]["weights"]) == k                                       # none is the actor's own
    sealed3 = run / "experience" / "iter_000003.parquet"
    before = sealed3.stat() if sealed3.exists() else None
    assert (before is not None) == (stage in ("seal", "update", "publish", "checkpoint"))

    summary, run = _train(tmp_path, "exact", *_extra(k), "run.resume=auto")
    want, whole_run = whole[k]
    assert summary["completed"] and summary["optimizer_steps"] == ITERATIONS
    assert summary["weights_hash"] == want["weights_hash"]          # bitwise the run never interrupted
    report = audit_run(run)
    assert report.ok, report.summary()
    assert report.num_iterations == ITERATIONS and report.num_samples == ITERATIONS * 16
    assert _ledger(run) == _ledger(whole_run)                      # same prompts per iteration, once each
    assert _sealed(run) == _sealed(whole_run)
    assert _consumed(run) == _consumed(whole_run)                  # same schedule: who sampled, who consumed
    if before is not None:   # sealed before the crash: the resumed run did not write it again
        after = sealed3.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_uninterrupted_runs_follow_the_fixed_lag(whole):
    """What the resumed runs are compared with: iteration i sampled by the version of step max(0, i - k)."""
    for k, (_, run) in whole.items():
        steps = [int(c["sampled_by"].split("@")[1].split(".")[0]) for c in _consumed(run)]
        assert steps == [max(0, i - k) for i in range(ITERATIONS)]
        norms = [json.loads(x)["actor/grad_norm"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert [n > 0 for n in norms[2:]] == [True] * (ITERATIONS - 2)   # the resumed iterations all learn
