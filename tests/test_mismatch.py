"""The train-vs-rollout mismatch: measured at the update's first step in every old_log_prob mode
(bypass included: no extra forward), held to algorithm.mismatch_tol as a named stop, and bypass
with a rollout precision other than the training one refused unless a tolerance is set."""
from __future__ import annotations

import json

import pytest

from sealrl.cli import main
from sealrl.config import ConfigError, build_config, check_config
from tests.test_pipeline import BASE

KEYS = ("k1", "k3", "abs_diff_max", "abs_diff_mean", "tokens")


def _run(tmp_path, name, *extra) -> tuple[int, list[dict]]:
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    status = main(["train", str(empty), *BASE, f"run.output_dir={tmp_path}", f"run.name={name}", *extra])
    path = tmp_path / name / "metrics.jsonl"
    return status, [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.parametrize("mode", ["bypass", "recompute"])
def test_every_iteration_logs_the_first_step_mismatch(tmp_path, mode):
    status, rows = _run(tmp_path, mode, f"algorithm.old_log_prob={mode}")
    assert status == 0 and len(rows) == 4
    for row in rows:
        assert all(f"logprob/current_vs_rollout_{k}" in row for k in KEYS)
        assert row["logprob/current_vs_rollout_tokens"] > 0
        # fp32, the weights that sampled: the lean decode and the training forward agree to rounding
        # (their parity test holds 1e-5 per token); a wrong token or version would be ~1 nat
        assert row["logprob/current_vs_rollout_abs_diff_max"] <= 1e-4
        assert 0.0 <= row["logprob/current_vs_rollout_abs_diff_mean"] <= row["logprob/current_vs_rollout_abs_diff_max"]
    if mode == "recompute":   # the first step's forward is the old one: the two measures agree
        for row in rows:
            assert row["logprob/current_vs_rollout_abs_diff_max"] == pytest.approx(
                row["logprob/old_vs_rollout_log_prob_abs_diff_max"], abs=1e-6)


def test_a_bf16_rollout_past_the_tolerance_is_a_named_stop(tmp_path, capsys):
    status, rows = _run(tmp_path, "bf16", "algorithm.old_log_prob=bypass", "rollout.dtype=bf16",
                        "algorithm.mismatch_tol=1e-3")
    err = capsys.readouterr().err
    assert status == 2 and "disagree by" in err and "algorithm.mismatch_tol=0.001" in err, err[-1500:]
    assert rows == []   # stopped in iteration 0's update: nothing of it trained or logged
    assert not (tmp_path / "bf16" / "experience" / "consumed.jsonl").exists()


def test_bypass_with_another_precision_needs_a_tolerance():
    with pytest.raises(ConfigError, match="set algorithm.mismatch_tol"):
        check_config(build_config(None, ["algorithm.old_log_prob=bypass", "rollout.dtype=bf16"]))
    check_config(build_config(None, ["algorithm.old_log_prob=bypass", "rollout.dtype=bf16",
                                     "algorithm.mismatch_tol=0.25"]))


def test_drop_group_drops_the_groups_past_the_tolerance_before_the_seal(tmp_path):
    """algorithm.mismatch_action=drop_group with a bf16 rollout: the tolerance is set at the median
    of iteration 0's per-group gaps (measured on a recompute run of the same samples), so the
    groups above it are dropped (ledger reason, quarantine) and the others sealed and trained, the
    run goes on and audits; with bypass the check's own forward finds the same groups."""
    from sealrl.audit import audit_run
    from sealrl.experience.store import read_iteration
    from sealrl.trainer.variants.mismatch import group_gaps
    bf16 = ["rollout.dtype=bf16"]
    status, _ = _run(tmp_path, "probe", "algorithm.old_log_prob=recompute", *bf16)
    assert status == 0
    first = read_iteration(tmp_path / "probe" / "experience" / "iter_000000.parquet")
    def key(group_id):   # the group without its run's name: the same prompt of iteration 0 in each run
        return group_id.split("/", 1)[1]
    gaps = {key(g): gap for g, gap in group_gaps(first, first.get("old_log_probs")).items()}
    tol = sorted(gaps.values())[len(gaps) // 2 - 1]   # half the groups lie above it
    over = {g for g, gap in gaps.items() if gap > tol}
    assert 0 < len(over) < len(gaps), gaps
    for mode in ("recompute", "bypass"):
        status, rows = _run(tmp_path, mode, f"algorithm.old_log_prob={mode}", *bf16, f"algorithm.mismatch_tol={tol!r}",
                            "algorithm.mismatch_action=drop_group")
        assert status == 0 and len(rows) == 4, mode
        run = tmp_path / mode
        sealed = read_iteration(run / "experience" / "iter_000000.parquet")
        assert {key(g) for g in sealed.group_ids} == set(gaps) - over, mode   # the others, sealed and trained
        ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
        dropped = {key(r["group_id"]): r["reason"] for r in ledger if r["iteration"] == 0 and r["status"] == "dropped"}
        assert set(dropped) == over and all("train-vs-rollout mismatch" in r for r in dropped.values())
        quarantined = [json.loads(x) for x in (run / "quarantine" / "iter_000000.jsonl").read_text().splitlines()]
        assert {key(q["group_id"]) for q in quarantined} == over
        assert rows[0]["groups/mismatch_dropped"] == len(over) and rows[0]["groups/dropped"] == len(over)
        assert rows[0]["logprob/current_vs_rollout_abs_diff_max"] <= tol   # what trained is within it
        report = audit_run(run)
        assert report.ok, report.summary()


def test_drop_group_needs_a_tolerance():
    with pytest.raises(ConfigError, match="mismatch_action=drop_group needs algorithm.mismatch_tol > 0"):
        build_config(None, ["algorithm.mismatch_action=drop_group"])
    with pytest.raises(ConfigError, match="stop | drop_group"):
        build_config(None, ["algorithm.mismatch_action=skip"])
