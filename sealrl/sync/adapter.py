"""Adapter-only weight sync (DESIGN section 10): with LoRA only the adapter factors travel.

A rollout replica pins the frozen base once (`RolloutEngine.pin_base`, verified like any full
version). Every later version is an `AdapterManifest`: the adapter tensors' entries (shape,
dtype, sha256, exactly as for full weights), the scaling of each adapted layer and the hash of
the base they apply to. Its `weights_hash` digests the base hash, the entries and the scalings,
so a policy version is identified by base hash + adapter hash, and the version id names both.
The replica checks the base hash against the one it pinned, verifies every adapter tensor,
and only then merges the adapter into a fresh copy of the adapted weights; staging and
activation stay two phases, so a failed check activates nothing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from sealrl.experience.ids import PolicyVersion
from sealrl.sync.manifest import (
    TensorEntry,
    WeightManifest,
    WeightSyncError,
    entries_digest,
    in_dtype,
    tensor_entry,
    verify_weights,
)


def adapter_weights_hash(base_hash: str, entries: Mapping[str, TensorEntry], scaling: Mapping[str, float]) -> str:
    """The version's weights_hash: sha256 of (base hash, adapter entries digest, scalings)."""
    text = json.dumps([base_hash, entries_digest(entries), sorted(scaling.items())])
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class AdapterManifest:
    """One policy version as an adapter on a pinned base: `<module>.lora_A` / `.lora_B` entries."""

    version: PolicyVersion            # weights_hash = adapter_weights_hash(base_hash, entries, scaling)
    base_hash: str                    # weights_hash of the base's own (full) manifest
    entries: Mapping[str, TensorEntry]
    scaling: Mapping[str, float]      # module -> alpha / r

    @property
    def adapter_hash(self) -> str:
        return entries_digest(self.entries)


def build_adapter_manifest(adapter: Mapping[str, torch.Tensor], scaling: Mapping[str, float], base_hash: str,
                           run_id: str, step: int, attempt: int, tokenizer_hash: str,
                           model_config_hash: str) -> AdapterManifest:
    entries = {name: tensor_entry(t) for name, t in sorted(adapter.items())}
    scaling = dict(sorted(scaling.items()))
    version = PolicyVersion(run_id=run_id, step=step, attempt=attempt,
                            weights_hash=adapter_weights_hash(base_hash, entries, scaling),
                            tokenizer_hash=tokenizer_hash, model_config_hash=model_config_hash)
    return AdapterManifest(version, base_hash, entries, scaling)


def verify_adapter(staged: Mapping[str, torch.Tensor], manifest: AdapterManifest, base_hash: str | None,
                   base_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Raise WeightSyncError naming what is wrong: no or another pinned base, a manifest that does
    not digest to its version, a missing / unexpected / corrupted adapter tensor (name order), or
    factors that do not fit the base layer they adapt."""
    if base_hash is None:
        raise WeightSyncError("<base>", "an adapter version needs a pinned base; this replica holds none")
    if manifest.base_hash != base_hash:
        raise WeightSyncError("<base>", f"adapter for base {manifest.base_hash[:12]}, this replica pinned "
                              f"base {base_hash[:12]}")
    if adapter_weights_hash(manifest.base_hash, manifest.entries, manifest.scaling) != manifest.version.weights_hash:
        raise WeightSyncError("<manifest>", f"base, entries and scalings do not digest to weights_hash "
                              f"{manifest.version.weights_hash[:12]} of version {manifest.version}")
    # the per-tensor checks of a full version, over the adapter's own entries
    plain = dataclasses.replace(manifest.version, weights_hash=entries_digest(manifest.entries))
    verify_weights(staged, WeightManifest(plain, manifest.entries))
    modules = {n.rsplit(".", 1)[0] for n in manifest.entries}
    for module in sorted(modules ^ set(manifest.scaling)):
        raise WeightSyncError(module, "has tensors but no scaling, or a scaling but no tensors")
    for module in sorted(modules):
        a, b = staged.get(f"{module}.lora_A"), staged.get(f"{module}.lora_B")
        shape = base_shapes.get(f"{module}.weight")
        if a is None or b is None:
            raise WeightSyncError(module, "needs both lora_A and lora_B")
        if shape is None:
            raise WeightSyncError(module, "adapts no weight of the base")
        if (b.shape[0], a.shape[1]) != tuple(shape) or a.shape[0] != b.shape[1]:
            raise WeightSyncError(module, f"factors B {tuple(b.shape)} @ A {tuple(a.shape)} do not fit "
                                  f"the base weight {tuple(shape)}")


def merge_adapter(base: dict[str, Tensor], adapter: dict[str, Tensor], scaling: dict[str, float],
                  ) -> dict[str, Tensor]:
    """Base weights with every adapted `<module>.weight` replaced by W + s * B @ A (a new
    tensor, in W's dtype); every other tensor is the base's own. The base is never written,
    so no unmerge is needed and no rounding accumulates from version to version."""
    merged = dict(base)
    for module, s in scaling.items():
        w = base[f"{module}.weight"]
        a, b = adapter[f"{module}.lora_A"], adapter[f"{module}.lora_B"]
        merged[f"{module}.weight"] = (w.float() + (b.float() @ a.float()) * s).to(w.dtype)
    return merged


def copy_once(state: Mapping[str, Tensor], copy: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """`copy` of every tensor of `state`, where names that share one tensor (tied embedding and
    LM head) share one copy: exported once, gathered once, sent once, counted once."""
    copies: dict[tuple, Tensor] = {}
    out = {}
    for name, t in state.items():
        alias = _alias(t)
        out[name] = copies[alias] if alias in copies else copies.setdefault(alias, copy(t))
    return out


def _alias(t: Tensor) -> tuple:
    """Equal for two views of one storage with one layout; a sharded DTensor is keyed by its
    local shard (the same on every rank for a tied pair), anything without storage by itself.
    An empty shard is keyed by its tensor: a rank's empty shards can share one address (seen: a
    (1,)-row value head's two Adam moments on rank 1 of 2), and aliasing them there only would
    skip a gather on that rank and leave the others waiting in it."""
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.numel() == 0:
        return (id(t),)
    try:
        return type(t), t.device, local.data_ptr(), t.dtype, tuple(t.shape), t.stride()
    except RuntimeError:
        return (id(t),)


def sync_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes a sync of `state` moves: each distinct storage once (tied embeddings count once)."""
    seen = {}
    for t in state.values():
        seen[(t.device, t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    return sum(seen.values())


def rollout_copy(state: dict[str, Tensor], manifest, dtype: str, base_hash: str | None):
    """What the rollout loads of an exported version: full weights in its `dtype` (in_dtype),
    or an adapter named against the base the rollout pinned (`base_hash`). A bf16 copy of the
    base is a base of its own, so the adapter on it is a version of its own, as a bf16 copy of
    full weights is; its factors stay fp32 (each merge runs in fp32 and rounds once)."""
    if not isinstance(manifest, AdapterManifest):
        return in_dtype(state, manifest, dtype)
    if base_hash is None or base_hash == manifest.base_hash:
        return state, manifest
    version = dataclasses.replace(manifest.version,
                                  weights_hash=adapter_weights_hash(base_hash, manifest.entries, manifest.scaling))
    return state, AdapterManifest(version, base_hash, manifest.entries, manifest.scaling)
