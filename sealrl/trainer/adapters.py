"""LoRA in the run's setup (models/lora.py): which models get an adapter, made in an order that
lets the rollout's template and the critic's backbone come from the plain policy, and the base
hashes a checkpoint records so that a resume on another base is refused."""
from __future__ import annotations

import torch

from sealrl.config import Config
from sealrl.models.lora import apply_lora, base_state, has_lora
from sealrl.rollout.backends import weightless_template
from sealrl.sync.manifest import build_manifest, in_dtype


def wrap_models(cfg: Config, model):
    """(actor model, rollout template, critic model or None) when actor.lora is on (the critic's
    backbone gets an adapter of the same shape; its value head trains in full).
    The template (the rollout engine's structure, no weights) and the critic's backbone are taken
    from the plain policy before its adapter is injected (peft rewrites the model in place).
    Seeds: the critic as without LoRA (run.seed + 1), the adapters' A factors run.seed + 2 / + 3."""
    template = weightless_template(model)
    critic = None
    if cfg.algorithm.name == "ppo":
        from sealrl.models.critic import CriticModel
        torch.manual_seed(cfg.run.seed + 1)
        critic = CriticModel.from_causal_lm(model)
        critic.backbone = apply_lora(critic.backbone, cfg.actor.lora, "actor.lora", cfg.run.seed + 3)
    model = apply_lora(model, cfg.actor.lora, "actor.lora", cfg.run.seed + 2)
    return model, template, critic


def base_hash(model) -> str | None:
    """weights_hash of the frozen base under a LoRA adapter (None without one)."""
    if not has_lora(model):
        return None
    return build_manifest({k: v.detach().cpu() for k, v in base_state(model).items()}, "base", 0, 0, "", ""
                          ).version.weights_hash


def pinned_base(model, base, dtype: str):
    """(state, manifest) the rollout pins: the base's tensors under their plain names, detached
    on the CPU, in rollout.dtype (`base`: the actor's base manifest; in_dtype)."""
    return in_dtype({k: v.detach().cpu() for k, v in base_state(model).items()}, base, dtype)
