"""The train-vs-rollout mismatch: measured at the update's first step in every old_log_prob mode
(bypass included: no extra forward), held to algorithm.mismatch_tol as a named stop, and bypass
with a rollout precision other than the training one refused unless a tolerance is set."""
from __future__ import annotations

import json

import pytest

from sealrl.cli import main
from sealrl.config import ConfigError, build_config, check_config
from tests.test_pipeline import BASE

KEYS = ("k1", "k3", "abs_diff_max", "tokens")


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
