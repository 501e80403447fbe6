"""A rollout role over a group of replicas, with the RolloutWorker interface the driver uses
(`version`, `load`, `generate`), so the driver loop is the same for one in-process worker,
a local group or a Ray pool (standalone or colocated).

- load(state, manifest): every replica stages and verifies the manifest, then switches
  (dispatch.sync_weights); afterwards all must serve manifest.version, else ReplicaVersionError.
- generate(requests, contract, version): split by group id over the replicas, joined by sample
  id (dispatch.generate_by_id); a replica failure raises WorkerError naming it, which the
  driver's ledger turns into a regeneration with the same seeds.
- `served` records, per generate call, which replica served which sample id and with which
  version (the driver can write it next to the ledger).
"""
from __future__ import annotations

from sealrl.experience import PolicyVersion, SamplingContract
from sealrl.placement.dispatch import ReplicaVersionError, generate_by_id, sync_weights
from sealrl.placement.workers import WorkerGroup
from sealrl.rollout.engine import GenerationRequest, RolloutSample
from sealrl.sync.manifest import WeightManifest


class RolloutPool:
    def __init__(self, group: WorkerGroup, timeout_s: float | None = None) -> None:
        self.group, self.timeout_s = group, timeout_s
        self.served: list[dict] = []   # one entry per generate call
        self.join_counts: dict[str, float] = {}

    @property
    def version(self) -> PolicyVersion | None:
        held = self.group.attr("version", timeout_s=self.timeout_s)
        if any(v != held[0] for v in held):
            raise ReplicaVersionError(f"rollout replicas serve different versions: {[str(v) for v in held]}")
        return held[0]

    def load(self, state, manifest: WeightManifest) -> PolicyVersion:
        return sync_weights(self.group, state, manifest, timeout_s=self.timeout_s)

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion) -> list[RolloutSample]:
        if not requests:
            return []
        runs = {tuple(r.group_id.split("/", 2)[:2]) for r in requests}  # group id: run/iter/prompt
        if len(runs) != 1:
            raise ValueError(f"RolloutPool.generate: requests of several (run, iteration): {sorted(runs)}")
        run_id, iteration = next(iter(runs))
        samples, metrics = generate_by_id(self.group, requests, contract, version, run_id, int(iteration),
                                          timeout_s=self.timeout_s)
        served = metrics.pop("served_by")
        self.served.append({"version": version.id, "replica_of": served})
        for k, v in metrics.items():
            self.join_counts[k] = self.join_counts.get(k, 0.0) + v
        return samples

    def close(self) -> None:
        self.group.close()
