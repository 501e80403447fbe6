"""Resume == uninterrupted: 6 iterations straight vs 3, SIGKILL, then resumed for 3 more."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.trainer.checkpoint import CheckpointError
from sealrl.trainer.driver import train
from sealrl.trainer.iteration_metrics import is_wall_clock

ARGS = ["run.name=r", "run.iterations=6", "run.progress=false", "run.checkpoint_every=1",
        "run.threads=1", "data.num_train=40", "eval.num=8", "data.prompts_per_iter=4", "rollout.n=4",
        "rollout.max_new_tokens=5", "actor.micro_batch_size=8", "actor.lr=1e-3", "actor.ppo_epochs=2",
        "actor.mini_batch_size=8", "actor.lr_schedule=cosine", "actor.warmup_steps=2"]


def _metrics(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # wall-clock figures (stage times, latencies, throughputs) differ between any two runs;
    # everything else is bitwise
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_killed_and_resumed_run_equals_straight_run(tmp_path, algo):
    extra = [f"algorithm.name={algo}"] + (["algorithm.kl_coef=0.05", "algorithm.kl_in=reward"] if algo == "ppo" else [])
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    cmd = [sys.executable, "-m", "sealrl.cli", "train", str(empty), *ARGS, *extra,
           f"run.output_dir={tmp_path / 'b'}"]
    env = dict(os.environ, SEALRL_FAULTS="after_checkpoint@3:kill")
    # the run to be killed (a new interpreter: seconds of imports) goes on while the straight run
    # trains in this process
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        train(build_config(None, ARGS + extra + [f"run.output_dir={tmp_path / 'a'}"]))
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -9, stderr[-2000:]
    b = tmp_path / "b" / "r"
    assert (b / "checkpoints" / "latest").read_text() == "step_3"
    assert not (b / "summary.json").exists()
    train(build_config(None, ARGS + extra + [f"run.output_dir={tmp_path / 'b'}", "run.resume=auto"]))
    a = tmp_path / "a" / "r"
    parts = ["actor_model", "actor_optim"] + (["critic_model", "critic_optim"] if algo == "ppo" else [])
    for part in parts:
        x = load_file(str(a / "checkpoints" / "step_6" / f"{part}.safetensors"))
        y = load_file(str(b / "checkpoints" / "step_6" / f"{part}.safetensors"))
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].equal(y[k]), f"{part}.{k} differs"
    assert _metrics(a) == _metrics(b)
    sa = json.loads((a / "summary.json").read_text())
    sb = json.loads((b / "summary.json").read_text())
    assert sa["accuracy_after"] == sb["accuracy_after"] and sa["iterations"] == sb["iterations"] == 6
    for run in (a, b):
        report = audit_run(run)
        assert report.ok, report.summary()


def test_incompatible_resume_is_refused_with_a_diff(tmp_path):
    args = ARGS[:] + [f"run.output_dir={tmp_path}"]
    args[1] = "run.iterations=1"
    train(build_config(None, args))
    with pytest.raises(CheckpointError, match=r"actor.lr: 0.001 -> 0.0005"):
        train(build_config(None, args + ["run.resume=auto", "actor.lr=5e-4", "run.iterations=2"]))
    with pytest.raises(CheckpointError, match="data_hash"):
        train(build_config(None, args + ["run.resume=auto", "data.num_train=41", "run.iterations=2"]))
