"""Device and precision of a role's model.

Training roles (actor, critic) keep fp32 master weights and fp32 AdamW state and run their
forward/backward under torch.autocast in the compute dtype (`compute`): matmuls in bf16,
reductions and the log-softmax in fp32 (the log-prob code upcasts the logits). Inference-only
roles (reference, rollout) hold their weights in the dtype itself (`cast_model`).

`resolve_device("auto")` is cuda when one is visible, else cpu; asking for cuda without one is a
ConfigError naming the key (`actor.device`, ...) instead of a crash deep in a forward. Every
role computes on its device and hands back CPU tensors: what the experience record seals and
hashes is always a CPU tensor. `process_group_backend` picks the data-parallel collectives.
"""
from __future__ import annotations

import contextlib

import torch

from sealrl.config import ConfigError
from sealrl.config.sections import DEVICES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {' | '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(name: str, key: str = "device") -> torch.device:
    """auto | cpu | cuda -> a torch.device (auto: cuda when available). `key` names the config
    key in the error when cuda is asked for and torch sees none."""
    if name not in DEVICES:
        raise ConfigError(f"{key} must be one of {' | '.join(DEVICES)}, got {name!r}", key)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda asked for, but torch sees no CUDA device (torch.cuda.is_available() "
                          f"is False; torch {torch.__version__}); use {key}=cpu or auto", key)
    return torch.device(name)


def process_group_backend(device: torch.device | str) -> str:
    """The torch.distributed backend of data-parallel ranks whose models live on `device`:
    nccl between CUDA devices, gloo on CPU (nccl has no CPU tensors, gloo no fast GPU path)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def compute(dtype: str, device: torch.device | str = "cpu"):
    """The context a training forward/backward runs in: nothing for fp32, autocast for bf16."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch_dtype(dtype))


def cast_model(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """An inference-only model's weights in `dtype`, in place (fp32: unchanged)."""
    return model if dtype == "fp32" else model.to(torch_dtype(dtype))


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def role_devices(cfg) -> dict[str, torch.device]:
    """The resolved device of each role of run config `cfg` (actor, critic, reference, rollout),
    checked before anything is built. With LoRA the reference is the actor's own model with the
    adapter off, so a reference.device that resolves elsewhere is refused."""
    p = cfg.placement
    gpu_replicas = p.backend == "ray" and p.gpus_per_replica > 0   # cuda is resolved inside each replica
    out = {role: resolve_device(getattr(cfg, role).device, f"{role}.device")
           for role in ("actor", "reference", "rollout") if not (role == "rollout" and gpu_replicas)}
    out["critic"] = out["actor"]   # the critic follows actor.device
    if gpu_replicas:
        out["rollout"] = torch.device("cuda" if cfg.rollout.device != "cpu" else "cpu")
    if cfg.actor.lora.rank and cfg.algorithm.kl_coef > 0 and out["reference"] != out["actor"]:
        raise ConfigError(f"reference.device={cfg.reference.device} resolves to {out['reference']}, but with "
                          f"actor.lora the reference is the actor's own model on actor.device={cfg.actor.device} "
                          f"({out['actor']})", "reference.device")
    if p.backend == "ray" and cfg.rollout.device == "cuda" and not gpu_replicas:   # auto is cpu in such a replica
        raise ConfigError("rollout.device=cuda with placement.backend=ray: the rollout replicas' Ray bundles ask "
                          "for CPUs only; set placement.gpus_per_replica (e.g. 1), or use rollout.device=auto or cpu",
                          "rollout.device")
    if p.backend == "ray" and p.rollout_pool == "colocated" and p.actor_ranks > 1 and out["actor"].type == "cuda":
        raise ConfigError("placement.rollout_pool=colocated with actor ranks on cuda: the shared bundles ask for "
                          "CPUs only (not built yet); use placement.rollout_pool=standalone or actor.device=cpu",
                          "placement.rollout_pool")
    return out
