"""The reference role off the driver (`placement.reference=ray`): one Ray actor holds the frozen
copy and computes the reference log-probs; the driver keeps only its version and puts what
comes back into the batch under the reference's name, as the in-process role does.

The batch goes to the actor through the object store (one copy); the log-probs come back as
one (B, T) fp32 tensor. The actor's bundle asks for `placement.cpus_per_rank` CPUs and
`placement.rank_resources` (a training-side forward), one GPU when `reference.device` is cuda.
Its node, host and versions are recorded in placement.json like every Ray worker's.
"""
from __future__ import annotations

from collections.abc import Callable

from sealrl.experience import ExperienceBatch, PolicyVersion, Role


class RemoteReference:
    """The reference role's interface (`compute`, `version`) over a Ray worker group of one."""

    def __init__(self, group, version: PolicyVersion, timeout_s: float) -> None:
        self.group, self.version, self.timeout_s = group, version, timeout_s

    def compute(self, batch: ExperienceBatch) -> None:
        lp = self.group.call("log_probs", self.group.put(batch), timeout_s=self.timeout_s)[0]
        batch.put("ref_log_probs", lp, Role.REFERENCE, self.version.id)

    def close(self) -> None:
        self.group.close()


def ray_reference(make: Callable[[], object], version: PolicyVersion, placement, cuda: bool,
                  closers: list) -> RemoteReference:
    """A Reference built by `make` inside its own Ray actor and bundle (see the module docstring)."""
    from sealrl.config.sections import ray_resources
    from sealrl.placement.workers import PoolSpec, RayPool, RayWorkerGroup
    pool = RayPool(PoolSpec(name="reference", roles=("reference",), num_cpus_per_worker=placement.cpus_per_rank,
                            num_gpus_per_worker=1.0 if cuda else 0.0, strategy=placement.strategy.upper(),
                            resources=ray_resources(placement.rank_resources, "placement.rank_resources")),
                   timeout_s=placement.timeout_s)
    closers.append(pool.close)
    group = RayWorkerGroup("reference", make, pool, timeout_s=placement.timeout_s,
                           threads=max(1, int(placement.cpus_per_rank)))
    closers.append(group.close)
    return RemoteReference(group, version, placement.timeout_s)
