"""ReMax through the driver: one greedy response per prompt, scored by the reward role, is each
group's baseline; it is a sealed fact (`baseline_scores`) and in the group's ledger row, the
advantage is the return minus it, and an edited baseline fails the audit."""
import json
import shutil

import pytest
import torch

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.experience.store import read_iteration
from sealrl.trainer.driver import train
from tests.harness import small_args

BASE = small_args("eval.num=8", "actor.micro_batch_size=8", "algorithm.name=remax")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("remax")
    train(build_config(None, BASE + [f"run.output_dir={out}", "run.name=remax"]))
    return out / "remax"


def _ledger(run_dir):
    return [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]


def test_baseline_is_the_greedy_reward_and_the_advantage_subtracts_it(run_dir):
    report = audit_run(run_dir)
    assert report.ok, report.summary()
    rows = {(r["iteration"], r["group_id"]): r for r in _ledger(run_dir)}
    for it in range(2):
        batch = read_iteration(run_dir / "experience" / f"iter_{it:06d}.parquet")
        base = batch.get("baseline_scores")
        mask = batch.get("response_mask")
        scores = torch.tensor([r.total for r in batch.get("reward_records")])
        for i, g in enumerate(batch.group_ids):
            greedy = rows[(it, g)]["baseline"]
            assert greedy["score"] == pytest.approx(float(base[i])) and greedy["tokens"] >= 1
            assert greedy["scorer"].startswith(batch.get("reward_records")[i].scorer)
        # no KL term: every valid token's return is the score, so A = score - baseline on each
        assert batch.has("advantages")
        want = (scores - base)[:, None].expand_as(mask)
        assert torch.allclose(batch.get("advantages")[mask], want[mask])


def test_an_edited_baseline_fails_the_audit(run_dir, tmp_path):
    copy = tmp_path / "remax"
    shutil.copytree(run_dir, copy)
    rows = _ledger(copy)
    next(r for r in rows if r["status"] == "committed")["baseline"]["score"] += 1.0
    (copy / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = audit_run(copy)
    assert any(v.check == "ledger" and "greedy score" in v.message for v in report.violations)
