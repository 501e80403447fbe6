import json
import subprocess
import sys

import pytest

from sealrl.config import build_config
from sealrl.trainer.driver import train


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sealrl.cli", *args], capture_output=True, text=True, timeout=300)


def _main(capsys, *args):
    """`sealrl ARGS` through the CLI's own main() in this process: the same parsing, output and
    exit status as a new interpreter, without ~4 s of imports per call (test_help and
    test_config.py run the real `python -m sealrl.cli` entry point)."""
    from sealrl.cli import main
    capsys.readouterr()
    returncode = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["sealrl", *args], returncode, out, err)


def test_help(capsys):
    out = _cli("train", "--help")   # the real entry point, once
    assert out.returncode == 0 and "usage: sealrl train" in out.stdout
    with pytest.raises(SystemExit) as done:
        _main(capsys, "eval", "--help")
    assert done.value.code == 0 and "usage: sealrl eval" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_run_checkpoint_and_model_folder(tmp_path, capsys):
    cfg = build_config(None, [f"run.output_dir={tmp_path}", "run.name=ev", "run.iterations=2",
                              "run.checkpoint_every=1", "data.num_train=32", "eval.num=20", "data.prompts_per_iter=4",
                              "rollout.n=2"])
    summary = train(cfg)
    run = tmp_path / "ev"
    final = json.loads(_main(capsys, "eval", str(run)).stdout)
    assert final["eval/accuracy"] == summary["accuracy_after"] and final["eval/num"] == 20
    # the last checkpoint holds the same weights as the final model
    at_step_2 = json.loads(_main(capsys, "eval", str(run / "checkpoints" / "step_2")).stdout)
    assert at_step_2["eval/accuracy"] == final["eval/accuracy"]
    step1 = _main(capsys, "eval", str(run / "checkpoints" / "step_1"), "--num", "10", "--pass-k", "4")
    out = json.loads(step1.stdout)
    assert out["eval/num"] == 10 and 0 <= out["eval/accuracy"] <= 1 and 0 <= out["eval/pass@4"] <= 1
    # the final model folder is a plain Hugging Face folder
    bare = _main(capsys, "eval", str(run / "model"), "--config", str(run / "config.yaml"), "--num", "20")
    assert json.loads(bare.stdout)["eval/accuracy"] == final["eval/accuracy"]
    missing = _main(capsys, "eval", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("sealrl: error:")


def test_a_wall_cap_stops_cleanly_at_an_iteration_boundary(tmp_path):
    """run.max_wall_s is a user's choice, not a failure: the run stops after the iteration that
    crossed it, with a committed checkpoint, says so, exits 0 and records completed: false."""
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("{}\n")
    out = _cli("train", str(cfg), f"run.output_dir={tmp_path}", "run.name=cap", "run.iterations=5",
               "run.max_wall_s=0.001", "data.num_train=16", "eval.num=4",
               "data.prompts_per_iter=2", "rollout.n=2", "run.loggers=")
    assert out.returncode == 0, out.stderr[-800:]
    assert "stopped at the wall cap (run.max_wall_s=0.001) after 1 of 5 iterations" in out.stderr
    summary = json.loads((tmp_path / "cap" / "summary.json").read_text())
    assert summary["completed"] is False and summary["iterations"] == 1
    assert (tmp_path / "cap" / "checkpoints" / "latest").read_text() == "step_1"


@pytest.mark.parametrize("given, want", [
    ({}, {"GOMP_SPINCOUNT": "3000"}),                                       # the CLI's bounded spin
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),       # the user's choice wins
    ({"GOMP_SPINCOUNT": "0"}, {"GOMP_SPINCOUNT": "0"}),
])
def test_the_cli_sets_the_openmp_wait_before_torch_loads_unless_the_user_did(given, want):
    """GNU OpenMP reads its wait settings once, when torch loads it: the CLI must set them at its
    own import, before anything imports torch, and leave a user's setting alone."""
    import os
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import json, os, sys; import sealrl.cli; assert 'torch' not in sys.modules; "
            "print(json.dumps({k: os.environ[k] for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT') if k in os.environ}))")
    out = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == want
