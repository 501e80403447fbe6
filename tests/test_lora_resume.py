"""LoRA runs resume like full ones: killed mid-way == uninterrupted, bitwise (adapter, optimizer,
metrics); the checkpoint holds the adapter only and names the base by hash, so a resume on
another base is refused with the diff."""
import json

import pytest
import torch
from safetensors.torch import load_file

from sealrl.audit import audit_run
from sealrl.config import EMBEDDED_MODEL, build_config
from sealrl.models.hf import load_causal_lm, save_causal_lm
from sealrl.trainer.driver import train
from sealrl.trainer.resume.checkpoint import CheckpointError
from tests.harness import small_args
from tests.helpers_resume import learned_metrics, straight_and_resumed

ARGS = small_args("run.name=r", "run.iterations=6", "run.checkpoint_every=1", "run.threads=1", "data.num_train=40",
                  "eval.num=8", "actor.micro_batch_size=8", "actor.ppo_epochs=2", "actor.mini_batch_size=8",
                  "actor.lr_schedule=cosine", "actor.warmup_steps=2", "algorithm.name=ppo", "algorithm.kl_coef=0.05",
                  "actor.lora.rank=4", "actor.lora.target_modules=q_proj,v_proj", "run.seed=0")


@pytest.mark.slow
def test_killed_lora_run_resumes_to_the_same_adapter_bitwise(tmp_path):
    a, b = straight_and_resumed(tmp_path, ARGS)
    step = a / "checkpoints" / "step_6"
    actor = load_file(str(step / "actor_model.safetensors"))
    # the adapter only: q_proj and v_proj of 4 layers, A and B each; the base is named by hash
    assert len(actor) == 16 and all(".lora_" in k for k in actor)
    critic = load_file(str(step / "critic_model.safetensors"))
    # the critic follows actor.lora: an adapter of the same shape, its value head trained in full
    assert sum(".lora_" in k for k in critic) == 16
    assert {k for k in critic if ".lora_" not in k} == {"value_head.weight", "value_head.bias"}
    state = json.loads((step / "state.json").read_text())
    assert set(state) >= {"actor_base_hash", "critic_base_hash"}
    for part in ["actor_model", "actor_optim", "critic_model", "critic_optim"]:
        x = load_file(str(step / f"{part}.safetensors"))
        y = load_file(str(b / "checkpoints" / "step_6" / f"{part}.safetensors"))
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].equal(y[k]), f"{part}.{k} differs"
    assert learned_metrics(a) == learned_metrics(b)
    # r (in + out) per factor pair
    assert {r["sync/bytes"] for r in learned_metrics(a)} == {4 * 4 * 2 * 4 * (128 + 128)}
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
