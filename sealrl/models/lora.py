"""LoRA adapters on a frozen base, with peft (DESIGN section 10).

`actor.lora.rank > 0` wraps the policy with peft's LoRA: every base weight is frozen and only
the low-rank factors A (r, in) and B (out, r) of each targeted linear layer train, so that
W' = W + (alpha / r) * B @ A. B starts at zero, so the initial policy is exactly the base.

Names: peft renames the base's tensors (`base_model.model.` prefix, `.base_layer` inside a
wrapped layer). `base_state` gives them back their plain names, so the base's hash equals the
hash of the same folder loaded without peft; `adapter_state` names each factor after its
plain module (`model.layers.0.self_attn.q_proj.lora_A`), the names the rollout engine merges
(sync/adapter.merge_adapter).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sealrl.config import ConfigError
from sealrl.models.hf import quiet, save_causal_lm

ADAPTER = "default"          # peft's name of the one adapter
_PREFIX = "base_model.model."
ALL_LINEAR = "all-linear"

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer


def has_lora(model: nn.Module) -> bool:
    """True when some layer of `model` carries a LoRA adapter (a policy or a critic backbone)."""
    if "peft" not in sys.modules:  # peft is imported only where an adapter is made (apply_lora)
        return False
    from peft.tuners.lora import LoraLayer
    return any(isinstance(m, LoraLayer) for m in model.modules())


def target_names(spec: str) -> list[str] | str:
    """`all-linear`, or the list of names of a comma list."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    return ALL_LINEAR if names == [ALL_LINEAR] else names


def check_targets(model: nn.Module, spec: str, key: str) -> None:
    """ConfigError naming the first target that is no linear layer of `model`, with those it has."""
    names = target_names(spec)
    if names == ALL_LINEAR:
        return
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for t in names:
        if t not in linear:
            raise ConfigError(f"{key}.target_modules: {t!r} matches no linear layer of the model "
                              f"(it has {', '.join(sorted(linear))})", f"{key}.target_modules")


def apply_lora(model: nn.Module, cfg, key: str, seed: int) -> "PeftModel":
    """`model` wrapped with a fresh LoRA adapter (rank, alpha, dropout, targets of `cfg`, a
    LoraConfig of sealrl.config); A is drawn from `seed`, B is zero. The base is frozen in place."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    check_targets(model, cfg.target_modules, key)
    torch.manual_seed(seed)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=target_names(cfg.target_modules), bias="none")
    return get_peft_model(model, peft_cfg)


def _plain(name: str) -> str:
    return name.replace(_PREFIX, "", 1).replace(".base_layer.", ".")


def base_state(model: nn.Module) -> dict[str, Tensor]:
    """The frozen base's tensors under their plain (peft-free) names; no copies. What trains
    (the adapter; a critic's value head) is not part of it."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {_plain(k): v for k, v in model.state_dict().items() if ".lora_" not in k and k not in trainable}


def adapter_layers(model: nn.Module) -> dict[str, "LoraLayer"]:
    """Plain module name -> its LoRA layer, in module order."""
    from peft.tuners.lora import LoraLayer
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            if ADAPTER not in m.lora_A:  # an embedding target (lora_embedding_A): not synced
                raise ConfigError(f"lora target {name} is not a linear layer", "actor.lora.target_modules")
            out[name.removeprefix(_PREFIX)] = m
    return out


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """`<module>.lora_A` (r, in) and `<module>.lora_B` (out, r) of every adapted layer; no copies."""
    out = {}
    for name, m in adapter_layers(model).items():
        out[f"{name}.lora_A"] = m.lora_A[ADAPTER].weight
        out[f"{name}.lora_B"] = m.lora_B[ADAPTER].weight
    return out


def adapter_scaling(model: nn.Module) -> dict[str, float]:
    """Plain module name -> alpha / r, the factor of B @ A in that layer."""
    return {name: float(m.scaling[ADAPTER]) for name, m in adapter_layers(model).items()}


def trainable_state(model: nn.Module) -> dict[str, Tensor]:
    """What a checkpoint or a rollback must hold: the whole state dict, or with LoRA only the
    trainable tensors (adapter factors, a critic's value head); the frozen base is named by hash."""
    if not has_lora(model):
        return model.state_dict()
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """The inverse of trainable_state; with LoRA the keys must be exactly the trainable ones."""
    if not has_lora(model):
        model.load_state_dict(state, strict=True)
        return
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    for name in sorted(want - set(state)):
        raise KeyError(f"adapter state: {name} is missing")
    for name in sorted(set(state) - want):
        raise KeyError(f"adapter state: {name} is not a trainable tensor of the model")
    model.load_state_dict(state, strict=False)


def merged_model(model: "PeftModel") -> nn.Module:
    """A plain transformers model with the adapter merged in (a copy; `model` is untouched)."""
    return copy.deepcopy(model).merge_and_unload()


def checkpoint_exports(model: nn.Module, tokenizer) -> dict:
    """The folders a checkpoint holds besides its tensors, as {name: writer(path)}: `model`, a
    Hugging Face folder; with LoRA `adapter`, the peft adapter folder (the base is not copied
    into every checkpoint; it is named by hash in the checkpoint's state)."""
    if not has_lora(model):
        return {"model": lambda path: save_causal_lm(model, tokenizer, path)}

    @quiet
    def adapter(path):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return {"adapter": adapter}


@quiet
def save_policy(model: nn.Module, tokenizer, run_dir: Path) -> None:
    """The final policy: `model/` a Hugging Face folder (merged when LoRA is on) and, with
    LoRA, `adapter/` a peft adapter folder that loads on the base with PeftModel.from_pretrained."""
    if not has_lora(model):
        save_causal_lm(model, tokenizer, run_dir / "model")
        return
    save_causal_lm(merged_model(model), tokenizer, run_dir / "model")
    model.save_pretrained(run_dir / "adapter")
    tokenizer.save_pretrained(run_dir / "adapter")
