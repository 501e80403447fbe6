"""Resume == uninterrupted: 6 iterations straight vs 3, SIGKILL, then resumed for 3 more."""
import json

import pytest
from safetensors.torch import load_file

from sealrl.audit import audit_run
from sealrl.config import build_config
from sealrl.trainer.driver import train
from sealrl.trainer.resume.checkpoint import CheckpointError
from tests.harness import small_args
from tests.helpers_resume import learned_metrics, straight_and_resumed

ARGS = small_args("run.name=r", "run.iterations=6", "run.checkpoint_every=1", "run.threads=1", "data.num_train=40",
                  "eval.num=8", "actor.micro_batch_size=8", "actor.ppo_epochs=2", "actor.mini_batch_size=8",
                  "actor.lr_schedule=cosine", "actor.warmup_steps=2", "run.seed=0")


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_killed_and_resumed_run_equals_straight_run(tmp_path, algo):
    extra = [f"algorithm.name={algo}"] + (["algorithm.kl_coef=0.05", "algorithm.kl_in=reward"] if algo == "ppo" else [])
    a, b = straight_and_resumed(tmp_path, ARGS + extra)
    parts = ["actor_model", "actor_optim"] + (["critic_model", "critic_optim"] if algo == "ppo" else [])
    for part in parts:
        x = load_file(str(a / "checkpoints" / "step_6" / f"{part}.safetensors"))
        y = load_file(str(b / "checkpoints" / "step_6" / f"{part}.safetensors"))
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].equal(y[k]), f"{part}.{k} differs"
    assert learned_metrics(a) == learned_metrics(b)
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
