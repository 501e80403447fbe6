"""Weight manifests: what a policy version's weights are, tensor by tensor (DESIGN section 5).

The actor builds a manifest of its logical tensors when it commits version v (EXPORTING(v));
every rollout replica stages the transferred tensors and calls `verify_weights` before it
switches its active-version pointer (ROLLOUT_LOADING(v) -> ROLLOUT_READY(v)). Per-tensor sha256
checksums catch a corrupted, truncated, missing or never-transferred tensor (a "success" with
stale weights fails the checksum), and the manifest's own digest becomes
`PolicyVersion.weights_hash`, so the version id names the exact bytes.

Checksums are over the raw bytes of the contiguous CPU tensor: the same values in the same
dtype give the same checksum on any machine, and a dtype change is a different version.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from sealrl.config import UserError
from sealrl.experience.ids import PolicyVersion


class WeightSyncError(UserError, RuntimeError):
    """Staged weights do not match the manifest; `tensor` names the first bad one.
    Pickles with its fields (it crosses process boundaries from Ray rollout replicas)."""

    def __init__(self, tensor: str, reason: str) -> None:
        super().__init__(f"weight sync: tensor {tensor!r}: {reason}")
        self.tensor = tensor
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.tensor, self.reason)


class TensorEntry(NamedTuple):
    shape: tuple[int, ...]
    dtype: str      # torch dtype name without the "torch." prefix, e.g. "float32"
    sha256: str     # hex digest of the raw bytes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the raw bytes of the contiguous CPU copy (any dtype, incl. bf16 and bool)."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest()


def tensor_entry(tensor: torch.Tensor) -> TensorEntry:
    return TensorEntry(tuple(tensor.shape), dtype_name(tensor.dtype), tensor_sha256(tensor))


PARALLEL_BYTES = 16 * 2 ** 20   # below this, one thread: starting the pool costs more than it saves


def view_key(t: torch.Tensor) -> tuple:
    """Two tensors with equal keys are views of the same bytes (tied embeddings)."""
    return t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset()


def checksums(tensors: list[torch.Tensor]) -> list[str]:
    """tensor_sha256 of each, in order; an alias (a tied LM head) is hashed once. hashlib
    releases the GIL on large buffers, so a large set (a model's weights at every sync) is
    hashed on all the CPUs this process may use: the same digests, in about 1/CPUs of the time."""
    keys = [view_key(t) for t in tensors]
    by_key = dict(zip(keys, tensors))   # one tensor per alias key, in first-seen order
    unique = list(by_key.values())
    workers = min(len(unique), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else os.cpu_count() or 1, 8)
    if workers < 2 or sum(t.numel() * t.element_size() for t in unique) < PARALLEL_BYTES:
        digests = [tensor_sha256(t) for t in unique]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="sealrl-sha256") as pool:
            digests = list(pool.map(tensor_sha256, unique))
    digest_of = dict(zip(by_key, digests))
    return [digest_of[k] for k in keys]


def entries_digest(entries: Mapping[str, TensorEntry]) -> str:
    """Digest of all entries in name order: the version's `weights_hash`."""
    rows = [[name, list(e.shape), e.dtype, e.sha256] for name, e in sorted(entries.items())]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


@dataclass(frozen=True)
class WeightManifest:
    """The logical tensors of one policy version: name -> (shape, dtype, sha256)."""

    version: PolicyVersion
    entries: Mapping[str, TensorEntry]

    def to_json(self) -> str:
        return json.dumps({
            "version": json.loads(self.version.to_json()),
            "entries": {n: [list(e.shape), e.dtype, e.sha256] for n, e in self.entries.items()},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "WeightManifest":
        d = json.loads(text)
        entries = {n: TensorEntry(tuple(s), dt, h) for n, (s, dt, h) in d["entries"].items()}
        return cls(PolicyVersion(**d["version"]), dict(sorted(entries.items())))


def build_manifest(state_dict: Mapping[str, torch.Tensor], run_id: str, step: int, attempt: int,
                   tokenizer_hash: str, model_config_hash: str) -> WeightManifest:
    """Checksum every tensor and stamp the version with the digest of the entries."""
    names = sorted(state_dict)
    digests = checksums([state_dict[n] for n in names])
    entries = {n: TensorEntry(tuple(state_dict[n].shape), dtype_name(state_dict[n].dtype), d)
               for n, d in zip(names, digests)}
    version = PolicyVersion(run_id=run_id, step=step, attempt=attempt,
                            weights_hash=entries_digest(entries), tokenizer_hash=tokenizer_hash,
                            model_config_hash=model_config_hash)
    return WeightManifest(version, entries)


def verify_weights(state_dict: Mapping[str, torch.Tensor], manifest: WeightManifest) -> None:
    """Raise WeightSyncError naming the first tensor (in name order) that does not match.

    Checks, in order: the manifest is self-consistent (its entries digest to the version's
    weights_hash), no tensor is missing or unexpected, and each tensor's shape, dtype and
    checksum equal its entry.
    """
    if entries_digest(manifest.entries) != manifest.version.weights_hash:
        raise WeightSyncError("<manifest>", f"entries do not digest to weights_hash "
                              f"{manifest.version.weights_hash[:12]} of version {manifest.version}")
    names, expected = set(state_dict), set(manifest.entries)
    for name in sorted(expected - names):
        raise WeightSyncError(name, "missing from the staged weights")
    for name in sorted(names - expected):
        raise WeightSyncError(name, "unexpected: not in the manifest")
    order = sorted(expected)
    for name in order:
        want, t = manifest.entries[name], state_dict[name]
        if tuple(t.shape) != tuple(want.shape):
            raise WeightSyncError(name, f"shape {tuple(t.shape)} != manifest {tuple(want.shape)}")
        if dtype_name(t.dtype) != want.dtype:
            raise WeightSyncError(name, f"dtype {dtype_name(t.dtype)} != manifest {want.dtype}")
    for name, got in zip(order, checksums([state_dict[n] for n in order])):
        want = manifest.entries[name]
        if got != want.sha256:
            raise WeightSyncError(name, f"checksum {got[:12]} != manifest {want.sha256[:12]}")


def in_dtype(state_dict: dict[str, torch.Tensor], manifest: WeightManifest, dtype: str,
             ) -> tuple[dict[str, torch.Tensor], WeightManifest]:
    """The exported weights in the rollout's dtype (`rollout.dtype`: fp32 | bf16), with a manifest
    whose checksums are over exactly those tensors (what the rollout loads and verifies), so a
    bf16 copy is its own version. fp32: the inputs unchanged. Non-float tensors keep their dtype."""
    if dtype == "fp32":
        return state_dict, manifest
    target = {"bf16": torch.bfloat16}[dtype]
    cast = {k: v.to(target) if v.is_floating_point() else v for k, v in state_dict.items()}
    v = manifest.version
    return cast, build_manifest(cast, v.run_id, v.step, v.attempt, v.tokenizer_hash, v.model_config_hash)
