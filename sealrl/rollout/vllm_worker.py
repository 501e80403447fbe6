"""Runs inside vLLM's worker process: load a staged version in place, and say what is held.

vLLM mixes this class into its worker (`LLM(worker_extension_cls=...)`); the engine calls its
methods by name through `LLM.collective_rpc`, so nothing but a path goes in and nothing but
checksums come out (vLLM's RPC serialises neither functions nor tensors without pickle).

- `sealrl_load(path)`: the worker's own in-place reload, `Worker.reload_weights(weights_iterator=
  ..., is_checkpoint_format=True)` (vLLM's layerwise reload: it re-runs each layer's weight
  loader and its post-processing, e.g. the CPU backend's repacking of linear weights into
  oneDNN / sgl-kernel buffers), fed from the safetensors file the engine staged. Assigning
  tensors to `model.load_weights` directly is what fails on CPU ('Parameter' object has no
  attribute 'weight_loader'): the packing replaced those parameters.
- `sealrl_held_entries()`: (shape, dtype, sha256) of every tensor the model computes with, in
  the Hugging Face names the manifest uses. The CPU backend keeps a linear layer's weights only
  inside its packed kernel buffer (the parameter is emptied), so they are read back through the
  kernel itself: `cpu_linear(I)` = I @ W^T = W^T, exact (every output is one product by 1.0 plus
  zeros). Fused modules (qkv_proj, gate_up_proj) are split back by their `output_sizes` into
  the names of `packed_modules_mapping`; a vocabulary padded to a multiple of 64 is cut back to
  its `org_vocab_size`. Where a module holds both a parameter and a kernel copy (the lm_head
  and embeddings on CPU), both are read and must agree.
- `sealrl_logsumexp_log_probs()`: log-probs computed as z - logsumexp(z), the formula of
  sealrl's own engine and of the training forward (models/logprobs.token_log_probs), in place of
  vLLM's `log_softmax`. On the CPU, torch's fp32 `log_softmax` over a 49,152-token row drops the
  tail's small terms while it sums (each lane adds them to a partial sum too large to register
  them), so the normalizer comes out low and every log-prob high: +3e-6 to +1e-5 nats per
  token on SmolLM2-135M against an fp64 reference, while `logsumexp` stays within 1e-6 of it
  (docs/benchmarks.md, "vLLM log-probs"). Set once at engine start on the worker's own sampler:
  its `compute_logprobs` (raw and greedy log-probs, prompt log-probs) and the top-k/top-p
  sampler's processed log-probs, which the sampler is told to return as logits and which are
  turned into log-probs here.
"""
from __future__ import annotations

import logging

import torch
from safetensors.torch import load_file

from sealrl.sync.manifest import tensor_entry


class SealrlWorkerExtension:
    """Methods added to vLLM's Worker (self is the worker)."""

    def sealrl_load(self, path: str) -> None:
        quiet_rotary_reload()
        weights = load_file(path)
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)

    def sealrl_logsumexp_log_probs(self) -> None:
        sampler = self.model_runner.sampler
        filters = getattr(sampler, "topk_topp_sampler", None)
        if sampler.logprobs_mode != "processed_logprobs" or getattr(filters, "logprobs_mode", None) is None:
            raise RuntimeError(f"sealrl: this vLLM's sampler ({type(sampler).__module__}) is not the one sealrl "
                               "knows how to give exact log-probs to (vLLM 0.32's v1 Sampler)")
        sample = filters.forward

        def forward(logits, generators, k, p):
            sampled, z = sample(logits, generators, k, p)
            return sampled, None if z is None else log_probs(z)

        sampler.compute_logprobs = log_probs
        filters.logprobs_mode = "processed_logits"   # the filtered logits come back; log_probs turns them
        filters.forward = forward

    def sealrl_held_entries(self) -> dict[str, list]:
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        dtype = self.model_config.dtype   # the sgl-kernel path keeps biases in fp32: exact casts back
        out: dict[str, list] = {}
        with torch.inference_mode():
            for mod_name, mod in model.named_modules():
                for p_name, param in mod.named_parameters(recurse=False):
                    for name, t in _logical(mod_name, mod, p_name, _held(mod, p_name, param), packed):
                        e = tensor_entry(t.to(dtype) if t.is_floating_point() else t)
                        out[name] = [list(e.shape), e.dtype, e.sha256]
        return out


class _RotaryIsNotAWeight(logging.Filter):
    """vLLM's layerwise reload warns "RotaryEmbedding: Failed to load weights" for every rotary
    layer at every reload: its cos/sin cache counts as a tensor to load, yet no checkpoint holds
    it (it is computed, and vLLM puts the existing one back). What the model holds after a load
    is checked tensor by tensor anyway (sealrl_held_entries), so only that one line is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def quiet_rotary_reload() -> None:
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _RotaryIsNotAWeight) for f in log.filters):
        log.addFilter(_RotaryIsNotAWeight())


def _held(mod, p_name: str, param: torch.Tensor) -> torch.Tensor:
    """The values the module computes with: the parameter, or the packed kernel's copy read back
    through the kernel when the CPU backend emptied the parameter."""
    t = param.detach()
    kernel = getattr(mod, "cpu_linear", None) if p_name == "weight" and t.ndim <= 2 else None
    if kernel is None:
        return t
    k = getattr(mod, "input_size_per_partition", None) or t.shape[-1]
    read = kernel(torch.eye(k, dtype=t.dtype, device=t.device), None, None).t().contiguous()
    if t.numel() == 0:
        return read
    if not torch.equal(read.to(t.dtype), t):
        return torch.full_like(t, float("nan"))   # kernel copy != parameter: fails every checksum
    return t


def _logical(mod_name: str, mod, p_name: str, t: torch.Tensor, packed: dict) -> list[tuple[str, torch.Tensor]]:
    """vLLM's tensor -> the Hugging Face tensors it holds (fused modules split, padding cut)."""
    prefix, _, leaf = mod_name.rpartition(".")
    org_vocab = getattr(mod, "org_vocab_size", None)
    if org_vocab is not None and t.ndim >= 1 and t.shape[0] > org_vocab:
        t = t[:org_vocab]
    parts = packed.get(leaf)
    sizes = getattr(mod, "output_sizes", None)
    if parts and sizes and len(parts) == len(sizes) and t.shape[0] == sum(sizes):
        base = f"{prefix}." if prefix else ""
        return [(f"{base}{part}.{p_name}", piece.contiguous())
                for part, piece in zip(parts, torch.split(t, list(sizes), dim=0))]
    return [(f"{mod_name}.{p_name}", t.contiguous())]


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension as z - logsumexp(z) in fp32 (module docstring)."""
    z = logits.float()
    return z - torch.logsumexp(z, dim=-1, keepdim=True)
