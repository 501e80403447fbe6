"""`sealrl eval`: load the policy of a run, a checkpoint or a model folder and evaluate it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from sealrl.config import Config, MissingInputError
from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash
from sealrl.models.lora import apply_lora, load_trainable_state, merged_model
from sealrl.roles.rollout import Rollout
from sealrl.sync.manifest import build_manifest
from sealrl.trainer import setup
from sealrl.trainer.evaluate import evaluate
from sealrl.trainer.resume.checkpoint import latest_checkpoint
from sealrl.trainer.resume.position import checkpoint_model_state


def evaluate_path(path: Path, cfg: Config, num: int | None, pass_k: int) -> dict:
    if num:   # a generated task makes eval.num held-out problems
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num=num))
    weights = None
    if (path / "COMMITTED").is_file():                      # a checkpoint folder
        model_dir, weights = cfg.model.path, checkpoint_model_state(path)
    elif (path / "model" / "config.json").is_file():         # a finished run
        model_dir = path / "model"
    elif (path / "checkpoints").is_dir():                    # an unfinished run
        folder = latest_checkpoint(path / "checkpoints")
        if folder is None:
            raise MissingInputError(f"{path} has no final model and no committed checkpoint")
        model_dir, weights = cfg.model.path, checkpoint_model_state(folder)
    else:                                                    # a Hugging Face model folder
        model_dir = path
    model, tokenizer = load_causal_lm(str(model_dir), trust_remote_code=cfg.model.trust_remote_code)
    if weights is not None and cfg.actor.lora.rank:   # a LoRA run's checkpoint: its adapter, merged
        peft = apply_lora(model, cfg.actor.lora, "actor.lora", seed=0)
        load_trainable_state(peft, weights)
        model = merged_model(peft)
    elif weights is not None:
        model.load_state_dict(weights, strict=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    manifest = build_manifest(state, "eval", 0, 0, tokenizer_hash(tokenizer), model_config_hash(model.config))
    vllm = setup.vllm_options(cfg)   # the run's rollout.backend (auto said on stderr)
    rollout = Rollout(model, tokenizer, cfg.rollout.device, vllm=vllm)
    try:
        rollout.load(state, manifest)
        data = setup.build_data(cfg, tokenizer)
        return evaluate(rollout, manifest.version, data.eval, setup.build_reward_fn(cfg), tokenizer,
                        cfg.rollout.max_new_tokens, cfg.eval.num, pass_k=pass_k,
                        temperature=cfg.rollout.temperature, seed=cfg.run.seed, num_scorers=cfg.reward.num_scorers,
                        timeout_s=cfg.reward.timeout_s)
    finally:
        if vllm is not None:
            rollout.engine.close()
