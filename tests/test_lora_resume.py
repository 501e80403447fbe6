"""LoRA runs resume like full ones: killed mid-way == uninterrupted, bitwise (adapter, optimizer,
metrics); the checkpoint holds the adapter only and names the base by hash, so a resume on
another base is refused with the diff."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from sealrl.audit import audit_run
from sealrl.config import EMBEDDED_MODEL, build_config
from sealrl.models.hf import load_causal_lm, save_causal_lm
from sealrl.trainer.checkpoint import CheckpointError
from sealrl.trainer.driver import train
from sealrl.trainer.iteration_metrics import is_wall_clock

ARGS = ["run.name=r", "run.iterations=6", "run.progress=false", "run.checkpoint_every=1",
        "run.threads=1", "data.num_train=40", "eval.num=8", "data.prompts_per_iter=4", "rollout.n=4",
        "rollout.max_new_tokens=5", "actor.micro_batch_size=8", "actor.lr=1e-3", "actor.ppo_epochs=2",
        "actor.mini_batch_size=8", "actor.lr_schedule=cosine", "actor.warmup_steps=2",
        "algorithm.name=ppo", "algorithm.kl_coef=0.05", "actor.lora.rank=4", "actor.lora.target_modules=q_proj,v_proj",
        "critic.lora.rank=2"]


def _metrics(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in rows]


@pytest.mark.slow
def test_killed_lora_run_resumes_to_the_same_adapter_bitwise(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    cmd = [sys.executable, "-m", "sealrl.cli", "train", str(empty), *ARGS, f"run.output_dir={tmp_path / 'b'}"]
    env = dict(os.environ, SEALRL_FAULTS="after_checkpoint@3:kill")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        train(build_config(None, ARGS + [f"run.output_dir={tmp_path / 'a'}"]))
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -9, stderr[-2000:]
    b = tmp_path / "b" / "r"
    assert (b / "checkpoints" / "latest").read_text() == "step_3"
    train(build_config(None, ARGS + [f"run.output_dir={tmp_path / 'b'}", "run.resume=auto"]))
    a = tmp_path / "a" / "r"
    step = a / "checkpoints" / "step_6"
    actor = load_file(str(step / "actor_model.safetensors"))
    # the adapter only: q_proj and v_proj of 4 layers, A and B each; the base is named by hash
    assert len(actor) == 16 and all(".lora_" in k for k in actor)
    critic = load_file(str(step / "critic_model.safetensors"))
    assert {k for k in critic if ".lora_" not in k} == {"value_head.weight", "value_head.bias"}
    state = json.loads((step / "state.json").read_text())
    assert set(state) >= {"actor_base_hash", "critic_base_hash"}
    for part in ["actor_model", "actor_optim", "critic_model", "critic_optim"]:
        x = load_file(str(step / f"{part}.safetensors"))
        y = load_file(str(b / "checkpoints" / "step_6" / f"{part}.safetensors"))
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].equal(y[k]), f"{part}.{k} differs"
    assert _metrics(a) == _metrics(b)
    assert {r["sync/bytes"] for r in _metrics(a)} == {4 * 4 * 2 * 4 * (128 + 128)}   # r (in + out) per factor pair
    for run in (a, b):
        report = audit_run(run)
        assert report.ok, report.summary()


def test_resume_on_another_base_is_refused_with_a_diff(tmp_path):
    model, tok = load_causal_lm(EMBEDDED_MODEL)
    save_causal_lm(model, tok, tmp_path / "base")
    args = ARGS[:] + [f"run.output_dir={tmp_path}", f"model.path={tmp_path / 'base'}"]
    args[1] = "run.iterations=1"
    train(build_config(None, args))
    with torch.no_grad():
        model.model.norm.weight.add_(0.01)   # the same folder now holds another base
    save_causal_lm(model, tok, tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"actor_base_hash: [0-9a-f]{64} -> [0-9a-f]{64}") as e:
        train(build_config(None, args + ["run.resume=auto", "run.iterations=2"]))
    assert "critic_base_hash" in str(e.value)
