"""A rollout role over a group of replicas, a client of the rollout seam (seams/rollout.py;
its capabilities are CLIENTS["ray_pool"]), so the driver loop is the same for one in-process
worker, a local group or a Ray pool (standalone or colocated). Each replica is a
RolloutReplica (roles/rollout.Rollout in a worker).

- load(state, manifest): two phases (dispatch.stage_all, dispatch.activate_all): every
  replica stages and verifies the manifest, and only if all verified do they all switch;
  afterwards all must serve manifest.version, else ReplicaVersionError. A failed load leaves
  every replica on the version it served before, and raises the first failed replica's
  WorkerError (its cause names the tensor).
- generate(requests, contract, version): split by group id over the replicas, joined by sample
  id (dispatch.generate_by_id). A replica that is lost mid-call (process died, deadline
  missed) is replaced by a fresh one that loads the active version, verified, and its shard
  is sent again with the same seeds (up to `max_replacements` per call); any other replica
  failure raises WorkerError naming it, which the driver's ledger turns into a regeneration
  with the same seeds.
- `history` records, in order, every load and generate call with its version, and every
  replacement; `served` records, per generate call, which replica served which sample id.

The pool keeps the shared state of the versions its replicas hold (the active one, and with
retain(k) the last k loaded; one copy each, in Ray's object store), and with LoRA the pinned
base, so a replacement replica can be brought to all of them, verified, without the actor.

Two threads may drive it at once (rollout.max_staleness >= 1): the generation lane calls
generate while the training lane calls load. Each replica runs two calls at once (its engine
stages and activates beside a running generate, which keeps the version it started with), and
the pool serialises what changes its own state: a load, and a replacement. A replica that both
threads find lost is replaced once: the second finds it already replaced and only re-sends.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from sealrl.experience import PolicyVersion, SamplingContract
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.placement.dispatch import ReplicaVersionError, activate_all, generate_by_id, replace_replica, stage_all
from sealrl.placement.workers import WorkerGroup
from sealrl.seams.rollout import CLIENTS
from sealrl.sync.manifest import WeightManifest
from sealrl.sync.remote import RemoteState
from sealrl.sync.versions import VersionSlots


class RolloutPool:
    capabilities = CLIENTS["ray_pool"].capabilities

    def __init__(self, group: WorkerGroup, timeout_s: float | None = None, max_replacements: int = 1) -> None:
        self.group, self.timeout_s, self.max_replacements = group, timeout_s, max_replacements
        self.served: list[dict] = []   # one entry per generate call
        self.history: list[tuple[str, str]] = []   # ("load" | "generate" | "replace k", version id)
        self.recoveries: list[float] = []          # seconds each replacement took, since the last take
        self.join_counts: dict[str, float] = {}
        self._retain = 1
        # (shared state, manifest) of the versions every replica holds: the pool's own slots (sync/versions.py)
        self.versions: VersionSlots[tuple[Any, WeightManifest]] = VersionSlots()
        self._base: tuple[Any, WeightManifest] | None = None   # LoRA: the pinned base, shared once
        self._backends: list | None = None   # what the replicas said after the last load
        self._lock = threading.RLock()   # a load or a replacement at a time (module docstring)

    @property
    def version(self) -> PolicyVersion | None:
        with self._lock:   # not halfway through a load's activation
            held = self.group.attr("version", timeout_s=self.timeout_s)
        if any(v != held[0] for v in held):
            raise ReplicaVersionError(f"rollout replicas serve different versions: {[str(v) for v in held]}")
        return held[0]

    @property
    def backend(self) -> tuple[str, str]:
        """(forward backend, dtype) every replica samples with, as they said after the last load
        (asked then, so that reading it never waits for a generation, nor fails with a replica
        that dies meanwhile); replicas that differ are an error."""
        with self._lock:
            if self._backends is None:
                self._backends = self.group.attr("backend", timeout_s=self.timeout_s)
            held = self._backends
        if any(b != held[0] for b in held):
            raise ReplicaVersionError(f"rollout replicas use different backends: {held}")
        return held[0]

    def load(self, state, manifest: WeightManifest) -> PolicyVersion:
        """Two phases: every replica stages and verifies `manifest`, then all switch. A replica
        found lost while staging (it died while idle: the likeliest moment, replicas idle most
        of an iteration) is replaced, brought to the versions the others serve, and the stage is
        tried again, up to `max_replacements` times; any other failure (a checksum) is raised
        and activates nothing."""
        with self._lock:
            return self._load(state, manifest)

    def _load(self, state, manifest: WeightManifest) -> PolicyVersion:
        shared = self.group.put(state if isinstance(state, RemoteState) else dict(state))  # once, not per replica
        for attempt in range(self.max_replacements + 1):
            failed = stage_all(self.group, shared, manifest, self.timeout_s)
            if not failed:
                break
            lost = sorted(k for k, e in failed.items() if e.lost)
            for k in lost:
                self._replace(k)  # back to the version the others still serve
            if len(lost) < len(failed) or attempt == self.max_replacements:
                raise failed[min(failed)]
        # every replica verified v: the commit point (a replica replaced from here on loads v)
        self.versions.activate(self.versions.stage(manifest.version, lambda: (shared, manifest)))
        activate_all(self.group, manifest.version, self.timeout_s, replace=self._replace)
        self._backends = self.group.attr("backend", timeout_s=self.timeout_s)
        self.history.append(("load", manifest.version.id))
        return manifest.version

    def _replace(self, k: int, seen: Any = None) -> None:
        """A fresh replica k brought to the pinned base and every held version. `seen`: the
        handle of replica k when the failed call was sent; if k has been replaced since (by
        the other thread), nothing is done: the caller re-sends to the new one."""
        with self._lock:
            if seen is not None and self._handle(k) is not seen:
                return
            t0 = time.perf_counter()
            held = [snap.held for snap in self.versions.held()]
            replace_replica(self.group, k, held, self._retain, self.timeout_s, base=self._base)
            self.recoveries.append(time.perf_counter() - t0)
            self.history.append((f"replace {k}", held[-1][1].version.id if held else ""))

    def _handle(self, k: int) -> Any:
        """Replica k's current handle (Ray groups replace theirs; a local group has none)."""
        actors = getattr(self.group, "actors", None)
        return None if actors is None else actors[k]

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion, stream=None) -> list[RolloutSample]:
        return self._generate("generate", requests, contract, version, stream=stream)

    def generate_switching(self, requests, contract, version, plan=None, resolve=None,
                           stream=None) -> list[RolloutSample]:
        """rollout.partial=switch: each replica's running rows move to a version when the pool
        activates it there (plan None), so each shard switches at its own token, recorded per
        sample; a replay's `plan` names the recorded versions themselves, which every replica
        waits for (`resolve`, a function of this process, cannot cross). `stream`: each shard as
        it arrives, as generate does."""
        if resolve is not None:
            raise ValueError("generate_switching on the replica pool: the plan's keys must be the versions "
                             "themselves (a resolve function cannot cross processes)")
        return self._generate("generate_switching", requests, contract, version, stream=stream, extra=(plan,))

    def _generate(self, method, requests, contract, version, stream=None, extra: tuple = ()) -> list[RolloutSample]:
        if not requests:
            return []
        self.history.append(("generate", version.id))
        handles = [self._handle(k) for k in range(self.group.num_workers)]   # a lost one is replaced once

        def replace(k: int) -> None:
            self._replace(k, handles[k])
            handles[k] = self._handle(k)
        samples, metrics = generate_by_id(self.group, requests, contract, version, timeout_s=self.timeout_s,
                                          replace=replace, max_replacements=self.max_replacements, stream=stream,
                                          method=method, extra=extra)
        served = metrics.pop("served_by")
        self.served.append({"version": version.id, "replica_of": served})
        for k, v in metrics.items():
            self.join_counts[k] = self.join_counts.get(k, 0.0) + v
        return samples

    def retain(self, versions: int) -> None:
        """Every replica keeps serving the last `versions` loaded versions (1 = only the active
        one); a replacement replica is brought to each of them."""
        with self._lock:
            self.versions.retain(versions)   # refuses versions < 1 before any replica is asked
            self.group.call("retain", versions, timeout_s=self.timeout_s)
            self._retain = versions

    def pin_base(self, state, manifest: WeightManifest) -> str:
        """LoRA: every replica pins the frozen base (verified), once; later versions are adapters
        merged into it on each replica, so a sync moves only the adapter. Returns the base's hash."""
        with self._lock:
            shared = self.group.put(dict(state))
            hashes = self.group.call("pin_base", shared, manifest, timeout_s=self.timeout_s)
            self._base = (shared, manifest)
            return hashes[0]

    def take_recoveries(self) -> list[float]:
        """Seconds each replica replacement took (start a fresh one, load the active version
        verified) since the last take (then forgotten)."""
        recoveries, self.recoveries = self.recoveries, []
        return recoveries

    def take_engine_stats(self) -> dict[str, float]:
        """The replicas' KV-cache facts since the last take: the largest peak, the mean use (a
        replica lost meanwhile is left out: its replacement counts in rollout/replica_replacements)."""
        settled = self.group.settle("take_engine_stats", {k: () for k in range(self.group.num_workers)},
                                    timeout_s=self.timeout_s)
        takes = [t for t in settled.values() if isinstance(t, dict) and t]   # a WorkerError is not a dict
        if not takes:
            return {}
        return {"kv_peak_gb": max(t["kv_peak_gb"] for t in takes),
                "kv_use": sum(t["kv_use"] for t in takes) / len(takes)}

    def take_served(self) -> list[dict]:
        """Who served which sample id, per generate call since the last take (then forgotten)."""
        served, self.served = self.served, []
        return served

    def close(self) -> None:
        self.group.close()
