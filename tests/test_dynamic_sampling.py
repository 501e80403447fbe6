"""DAPO dynamic sampling end to end: zero-variance groups are filtered (recorded with their
reason and counted), more prompts are sampled in further rounds, `sealrl audit` passes and the
ledger accounts for every generated group; a record edited to hide a filtered group fails."""
import json
from collections import Counter

import pytest

from sealrl.audit import audit_run
from sealrl.config import ConfigError, build_config, check_config
from sealrl.experience.store import read_iteration
from sealrl.trainer.driver import train
from tests.harness import small_args

# the warm-start model is sure of most arithmetic prompts (all right or all wrong): groups of 8
# with zero variance are the common case, as late in the demo
BASE = small_args("eval.num=8", "rollout.n=8", "actor.micro_batch_size=8", "actor.lr=1e-4",
                  "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=4")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dynamic")
    train(build_config(None, BASE + [f"run.output_dir={out}", "run.name=ds"]))
    return out / "ds"


def _ledger(run_dir):
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def test_every_generated_group_is_trained_filtered_or_dropped(run_dir):
    report = audit_run(run_dir)
    assert report.ok, report.summary()
    rows = _ledger(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["status"] == "filtered" for r in rows) > 0          # the case under test happened
    for it, m in enumerate(metrics):
        mine = [r for r in rows if r["iteration"] == it]
        status = Counter(r["status"] for r in mine)
        assert set(status) <= {"committed", "filtered", "dropped"}
        rounds = 1 + max(r["round"] for r in mine)
        # generated = rounds full batches of data.prompts_per_iter prompts
        assert status["committed"] + status["filtered"] + status["dropped"] == len(mine) == 4 * rounds
        assert m["groups/committed"] == status["committed"] and m["groups/filtered"] == status["filtered"]
        assert m["groups/dropped"] == status["dropped"] and m["groups/sampling_rounds"] == rounds
        assert status["committed"] <= 4                                 # never more than the target
        assert all(r["reason"].startswith("zero variance") for r in mine if r["status"] == "filtered")
        batch = read_iteration(run_dir / "experience" / f"iter_{it:06d}.parquet")
        trained = set(batch.group_ids)
        assert trained == {r["group_id"] for r in mine if r["status"] == "committed"}
        for g in trained:   # every trained group carries signal: its scores vary
            scores = {r.total for r, gid in zip(batch.get("reward_records"), batch.group_ids) if gid == g}
            assert len(scores) > 1


def _tampered(run_dir, tmp_path, edit):
    import shutil
    copy = tmp_path / "ds"
    shutil.copytree(run_dir, copy)
    rows = edit(_ledger(copy))
    (copy / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return audit_run(copy)


def test_hiding_a_filtered_group_fails_the_audit(run_dir, tmp_path):
    def hide(rows):
        i = next(i for i, r in enumerate(rows) if r["status"] == "filtered")
        return rows[:i] + rows[i + 1:]
    report = _tampered(run_dir, tmp_path, hide)
    assert not report.ok
    assert any(v.check == "ledger" and "the sampler passed" in v.message for v in report.violations)


def test_hiding_a_whole_trailing_round_fails_the_audit(run_dir, tmp_path):
    """Counts alone cannot see a missing last round (every remaining round matches its batch);
    the replay knows over-sampling only stops when it must."""
    rows = _ledger(run_dir)
    last = {}
    for r in rows:
        last[r["iteration"]] = max(last.get(r["iteration"], 0), r["round"])
    # an iteration whose last round trained nothing (this seeded run has one)
    it = next(i for i, rd in last.items()
              if rd > 0 and not any(r["iteration"] == i and r["round"] == rd and r["status"] == "committed"
                                    for r in rows))
    report = _tampered(run_dir, tmp_path, lambda rs: [r for r in rs if (r["iteration"], r["round"]) != (it, last[it])])
    assert any(v.check == "ledger" and "a round is missing" in v.message for v in report.violations)


def test_a_filtered_group_passed_off_as_trained_fails_the_audit(run_dir, tmp_path):
    def claim(rows):
        r = next(r for r in rows if r["status"] == "filtered")
        r["status"], r["reason"] = "committed", ""
        return rows
    report = _tampered(run_dir, tmp_path, claim)
    assert any(v.check == "ledger" and "absent from the iteration's experience file" in v.message
               for v in report.violations)


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        check_config(build_config(None, ["algorithm.dynamic_sampling=true", "rollout.n=1"]))
