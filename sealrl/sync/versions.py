"""The versions a rollout holds: stage, verify, activate, retain (DESIGN sections 5 and 11). One
mechanism for every rollout client; what a snapshot holds is the client's (the native engine
keeps a forward backend, the Ray pool the shared state and manifest a replacement replica
loads, another engine would keep its own handle).

What it guarantees:

- a version is staged as a private copy whose every checksum (and, for full weights, every
  tensor's fit to the model) is verified before anything serves it (`verified_copy`,
  `verified_adapter`); a failed stage leaves nothing staged and the active version unchanged;
- `activate` switches to the staged version with one reference assignment, so a generate call
  that already read its snapshot keeps it to the end; activating the version already active is
  a no-op (a repeated activation is harmless);
- with `retain(k)` the last k activated versions keep serving (an asynchronous pipeline samples
  from a version up to rollout.max_staleness publications behind); each holds its own copy.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from torch import Tensor

from sealrl.experience.ids import PolicyVersion
from sealrl.experience.wire import VersionNotHeldError
from sealrl.sync.adapter import AdapterManifest, merge_adapter, verify_adapter
from sealrl.sync.manifest import WeightManifest, WeightSyncError, verify_weights, view_key

Held = TypeVar("Held")


@dataclass(frozen=True)
class Snapshot(Generic[Held]):
    version: PolicyVersion
    held: Held                  # what serves the version (the engine's forward backend)


class VersionSlots(Generic[Held]):
    """The active version, at most one staged (verified, not yet active), and the retained ones."""

    def __init__(self) -> None:
        self._active: Snapshot[Held] | None = None
        self._staged: Snapshot[Held] | None = None
        self._retired: list[Snapshot[Held]] = []   # earlier active versions still served (retain)
        self._retain = 1

    @property
    def active(self) -> Snapshot[Held] | None:
        return self._active

    @property
    def active_version(self) -> PolicyVersion | None:
        snap = self._active
        return None if snap is None else snap.version

    @property
    def staged_version(self) -> PolicyVersion | None:
        snap = self._staged
        return None if snap is None else snap.version

    def retain(self, versions: int) -> None:
        """Keep serving the last `versions` activated versions (1 = only the active one)."""
        if versions < 1:
            raise ValueError(f"retain: versions must be >= 1, got {versions}")
        self._retain = versions
        self._retired = self._retired[len(self._retired) - (versions - 1):] if versions > 1 else []

    def stage(self, version: PolicyVersion, build: Callable[[], Held]) -> PolicyVersion:
        """ROLLOUT_LOADING(v): `build()` verifies and makes what serves `version`; kept staged,
        replacing an earlier staged one. If it raises, nothing is staged."""
        self._staged = None
        self._staged = Snapshot(version, build())
        return version

    def activate(self, version: PolicyVersion) -> PolicyVersion:
        """ROLLOUT_READY(v): switch to the staged `version` with one reference assignment."""
        snap = self._staged
        if snap is not None and snap.version == version:
            if self._retain > 1 and self._active is not None:
                self._retired = (self._retired + [self._active])[-(self._retain - 1):]
            self._active, self._staged = snap, None  # the swap
        elif self.active_version != version:
            held = "nothing" if snap is None else str(snap.version)
            raise VersionNotHeldError(f"asked to activate {version}, this replica has {held} staged")
        return version

    def held(self) -> list[Snapshot[Held]]:
        """Every snapshot that serves, oldest first: the retained ones, then the active one (what
        a replacement must load, in this order, to hold the same)."""
        snap = self._active
        return [*self._retired, snap] if snap is not None else list(self._retired)

    def discard_staged(self) -> None:
        """Drop a staged copy that will not be activated (another replica failed to verify)."""
        self._staged = None

    def serving(self, version: PolicyVersion | None = None) -> Snapshot[Held]:
        """The snapshot serving `version` (None: the active one), retained or active;
        VersionNotHeldError when it is not held."""
        snap = self._active  # read once
        if version is not None and snap is not None and snap.version != version:
            snap = next((r for r in self._retired if r.version == version), snap)
        if snap is None or (version is not None and snap.version != version):
            held = "nothing" if snap is None else str(snap.version)
            raise VersionNotHeldError(f"asked to generate with {version}, this replica holds {held}")
        return snap


def private_copy(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A private CPU copy of every tensor; aliases (tied embeddings) stay aliases."""
    staged, copies = {}, {}
    for name, t in state_dict.items():
        t = t.detach()
        key = view_key(t)
        if key not in copies:
            copies[key] = t.to("cpu", copy=True)
        staged[name] = copies[key]
    return staged


def verified_copy(state_dict: Mapping[str, Tensor], manifest: WeightManifest,
                  expected: Mapping[str, tuple[int, ...]]) -> dict[str, Tensor]:
    """A private copy of full weights, every checksum verified and every tensor fitting the
    model's `expected` shapes; WeightSyncError names the first tensor that does not."""
    staged = private_copy(state_dict)
    verify_weights(staged, manifest)
    for name, shape in expected.items():  # the manifest must fit this architecture
        if name not in staged:
            raise WeightSyncError(name, "needed by the rollout model, absent from the manifest")
        if tuple(staged[name].shape) != shape:
            raise WeightSyncError(name, f"shape {tuple(staged[name].shape)} != model {shape}")
    for name in staged.keys() - expected.keys():
        raise WeightSyncError(name, "not a tensor of the rollout model")
    return staged


def verified_adapter(state_dict: Mapping[str, Tensor], manifest: AdapterManifest,
                     base: tuple[str, dict[str, Tensor]] | None) -> dict[str, Tensor]:
    """LoRA: the adapter verified against its manifest and the pinned `base` (hash, weights),
    merged into a fresh copy of the base's adapted weights."""
    staged = private_copy(state_dict)
    base_hash, weights = base or (None, {})
    verify_adapter(staged, manifest, base_hash, {n: tuple(t.shape) for n, t in weights.items()})
    return merge_adapter(weights, staged, manifest.scaling)
