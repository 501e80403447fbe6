"""Forward backends of the rollout engine: the lean Llama/Qwen2 path and the plain HF fallback.

Both hold the weights of exactly one policy version and expose the same three calls:

    prefill(ids (G,P), positions (G,P), valid (G,P), max_len) -> (logits (G,V), cache)
    select(cache, rows (B,)) -> cache          fan-out (rows repeat) or compaction (rows drop)
    decode(cache, ids (B,), positions (B,), valid (B, L+1) or None) -> logits (B,V)

`valid` marks real (non-padding) key columns; None in decode means no column is padding.
A cache belongs to one generate call of one backend, so it can never outlive the version that
filled it.
"""
from __future__ import annotations

import copy
import inspect

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from sealrl.rollout.lean import KVCache, LeanCausalLM, lean_unsupported_reason


def weightless_template(model: PreTrainedModel, trainable: bool = False) -> PreTrainedModel:
    """A copy of `model` whose state-dict tensors live on the meta device.

    It keeps the structure and the non-persistent buffers (e.g. RoPE frequencies) the HF
    forward needs, and costs no memory per weight: the deepcopy memo maps every parameter and
    persistent buffer to a meta tensor up front, so no weight is ever copied (a tied pair
    stays one tensor). Each version's weights are assigned into a fresh copy of it. `trainable`:
    each parameter keeps its requires_grad and the copy its training mode (a data-parallel
    rank's model, filled from rank 0: roles/distributed.fill_from_rank0).
    """
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=trainable and p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                memo.setdefault(id(b), b.detach().to("meta"))
    copied = copy.deepcopy(model, memo)
    return copied if trainable else copied.eval()


def allocate(template: torch.nn.Module, device: torch.device | str) -> None:
    """Storage on `device` for every parameter and persistent buffer of a weightless_template
    copy, in place, values unset (to be loaded). Its non-persistent buffers (e.g. RoPE
    frequencies, which no state dict holds) keep their values: to_empty would replace them too."""
    kept = [(m, name, b) for m in template.modules() for name, b in m._buffers.items()
            if b is not None and name in m._non_persistent_buffers_set]
    template.to_empty(device=device)
    for m, name, b in kept:
        m._buffers[name] = b.to(device)


class LeanBackend:
    """Static-cache prefill/decode on plain tensors (see lean.py)."""

    def __init__(self, weights: dict[str, Tensor], template: PreTrainedModel,
                 device: torch.device) -> None:
        self.lm = LeanCausalLM(weights, template.config, template.base_model.rotary_emb, device)
        self.dtype = self.lm.dtype

    def prefill(self, ids: Tensor, positions: Tensor, valid: Tensor, max_len: int,
                ) -> tuple[Tensor, KVCache]:
        G, P = ids.shape
        cache = self.lm.new_cache(G, max_len)
        if bool(valid.all()):  # no padding: SDPA's built-in causal mask, no mask tensor
            return self.lm.forward(ids, positions, cache, None, causal=True), cache
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=ids.device)
        # Padding queries attend to themselves so that no softmax row is empty (no NaN); their
        # outputs are never read because real tokens never attend to padding keys.
        mask = (causal & valid[:, None, :]) | eye  # (G, P, P)
        return self.lm.forward(ids, positions, cache, mask[:, None]), cache

    def select(self, cache: KVCache, rows: Tensor) -> KVCache:
        return cache.select(rows)

    def decode(self, cache: KVCache, ids: Tensor, positions: Tensor, valid: Tensor | None,
               ) -> Tensor:
        mask = None if valid is None else valid[:, None, None, :]  # (B, 1, 1, L+1)
        return self.lm.forward(ids[:, None], positions[:, None], cache, mask)


class HFBackend:
    """The HF module's own forward with a DynamicCache; for architectures lean.py lacks."""

    def __init__(self, weights: dict[str, Tensor], template: PreTrainedModel,
                 device: torch.device) -> None:
        model = copy.deepcopy(template)
        model.load_state_dict(weights, strict=True, assign=True)
        self.model = model.to(device).eval()
        self.dtype = self.model.dtype
        # transformers 5.25 renamed `past_key_values` to `cache`; the forward takes either
        # name through **kwargs and silently drops the one it does not know, which would decode
        # every step without its context (seen on an H200 image with transformers 5.17).
        params = inspect.signature(self.model.forward).parameters
        self._cache_key = "cache" if "cache" in params else "past_key_values"

    def prefill(self, ids: Tensor, positions: Tensor, valid: Tensor, max_len: int,
                ) -> tuple[Tensor, DynamicCache]:
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=valid.long(), position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_key: cache})
        if cache.get_seq_length() != ids.shape[1]:
            raise RuntimeError(f"{type(self.model).__name__}.forward did not fill the KV cache passed as "
                               f"`{self._cache_key}` (holds {cache.get_seq_length()} of {ids.shape[1]} "
                               "positions): this transformers version names it differently")
        return out.logits[:, -1].float(), cache

    def select(self, cache: DynamicCache, rows: Tensor) -> DynamicCache:
        cache.batch_select_indices(rows)
        return cache

    def decode(self, cache: DynamicCache, ids: Tensor, positions: Tensor, valid: Tensor | None,
               ) -> Tensor:
        mask = None if valid is None else valid.long()
        out = self.model(input_ids=ids[:, None], attention_mask=mask,
                         position_ids=positions[:, None], use_cache=True, **{self._cache_key: cache})
        return out.logits[:, -1].float()


def make_backend(weights: dict[str, Tensor], template: PreTrainedModel, device: torch.device,
                 prefer_lean: bool = True) -> LeanBackend | HFBackend:
    """The lean backend when it supports the architecture, else the HF one."""
    if prefer_lean and lean_unsupported_reason(template.config) is None:
        return LeanBackend(weights, template, device)
    return HFBackend(weights, template, device)
