"""The final policy (`runs/<name>/model`) and every checkpoint (`checkpoints/step_N/model`) are
Hugging Face folders that transformers loads as they are, holding the trained weights bit for
bit and giving the log-probs the run sampled with."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sealrl.config import build_config
from sealrl.experience.store import read_iteration
from sealrl.models.logprobs import response_log_probs
from sealrl.sync.manifest import build_manifest
from sealrl.trainer.driver import train
from sealrl.trainer.resume.checkpoint import load_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow   # a 2-iteration run of the embedded model (~15 s on one core)


def load_hf(folder):
    """As a user would, with transformers alone."""
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def weights_hash(model) -> str:
    return build_manifest(model.state_dict(), "x", 0, 0, "", "").version.weights_hash


def test_checkpoints_and_final_policy_load_in_transformers(tmp_path):
    # PPO: the critic's advantages are not zero even where every reward is equal, so each
    # update changes the weights
    summary = train(build_config(None, [
        f"run.output_dir={tmp_path}", "run.name=exp", "run.iterations=2", "run.checkpoint_every=1",
        "run.threads=1", "data.num_train=64", "eval.num=8", "data.prompts_per_iter=8",
        "rollout.n=4", "rollout.max_new_tokens=5", "actor.micro_batch_size=32", "algorithm.name=ppo"]))
    run = tmp_path / "exp"
    hashes = {}
    for name in ("checkpoints/step_1/model", "checkpoints/step_2/model", "model"):
        model, tok = load_hf(run / name)
        hashes[name] = weights_hash(model)
        assert tok.decode(tok("12+30=")["input_ids"], skip_special_tokens=True) == "12+30="
    assert hashes["model"] == hashes["checkpoints/step_2/model"] == summary["weights_hash"]
    assert hashes["checkpoints/step_1/model"] != hashes["model"]   # the second update changed them
    # the export is part of the commit: checksummed in the marker, equal to the resumable weights
    marker = verify_checkpoint(run / "checkpoints/step_1")
    assert "model/model.safetensors" in marker["files"] and "model/config.json" in marker["files"]
    tensors, _ = load_checkpoint(run / "checkpoints/step_1", ["actor_model"])
    step_1, _ = load_hf(run / "checkpoints/step_1/model")
    assert all(torch.equal(step_1.state_dict()[k], v) for k, v in tensors["actor_model"].items())
    # iteration 1 sampled from the policy after iteration 0's update: the step_1 export gives
    # the log-probs the rollout recorded (parity <= 1e-5, fp32)
    batch = read_iteration(run / "experience" / "iter_000001.parquet")
    with torch.no_grad():
        lp, _, mask = response_log_probs(step_1, [list(s.prompt_ids) for s in batch.samples],
                                         [list(s.response_ids) for s in batch.samples])
    assert mask.sum() > 0 and (batch.get("rollout_log_probs") - lp).abs().max() <= 1e-5
