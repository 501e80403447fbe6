"""Device and precision of a role's model.

Training roles (actor, critic) keep fp32 master weights and fp32 AdamW state and run their
forward/backward under torch.autocast in the compute dtype (`compute`): matmuls in bf16,
reductions and the log-softmax in fp32 (the log-prob code upcasts the logits). Inference-only
roles (reference, rollout) hold their weights in the dtype itself (`cast_model`).

`resolve_device("auto")` is cuda when one is visible, else cpu; asking for cuda without one is a
clear error instead of a crash deep in a forward.
"""
from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("auto", "cpu", "cuda")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {' | '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda -> a torch.device (auto: cuda when available)."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {' | '.join(DEVICES)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda asked for, but torch sees no CUDA device (torch.cuda.is_available() "
                         "is False); use device=cpu or auto")
    return torch.device(name)


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
