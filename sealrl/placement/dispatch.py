"""Dispatch role work to a worker group by id and join the results by sample id.

`generate_by_id`: GENERATING(v) over a pool of rollout replicas. Requests are split by group
id (sorted, contiguous ranges: join.split_ids), so the split does not depend on the order the
driver built them in; results come back per worker and are joined by (run, iteration, sample
id, "rollout", version id). It consumes requests whose samples all belong to version v; it
waits for every replica's shard (one deadline, WorkerGroup.timeout); a replica that answers
with another version, twice for an id, or not at all makes the join fail loudly.

`sync_weights`: EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v) on every replica: the
state is put once (Ray object store, or shared in-process), every replica stages and verifies
the manifest (RolloutEngine.load_weights) and only then switches; then every replica must
report version v. A replica whose verification fails keeps its previous version and the error
names the tensor (WorkerError.cause is the WeightSyncError).
"""
from __future__ import annotations

from collections.abc import Mapping

from sealrl.experience import PolicyVersion, SamplingContract, sample_id
from sealrl.placement.join import ResultJoin, ResultKey, split_ids
from sealrl.placement.workers import WorkerGroup
from sealrl.rollout.engine import GenerationRequest, RolloutSample


class ReplicaVersionError(RuntimeError):
    """After a sync, the rollout replicas do not all serve the expected version."""


def generate_by_id(group: WorkerGroup, requests: list[GenerationRequest], contract: SamplingContract,
                   version: PolicyVersion, run_id: str, iteration: int,
                   timeout_s: float | None = None) -> tuple[list[RolloutSample], dict]:
    """Samples of every requested candidate (in request, then candidate order, as the local
    RolloutWorker returns them) and the join's metrics, incl. which replica served each id."""
    by_group = {r.group_id: r for r in requests}
    if len(by_group) != len(requests):
        raise ValueError("generate_by_id: one request per group id (merge candidates first)")
    shards = split_ids(by_group, group.num_workers)
    expected = [sample_id(r.group_id, c) for r in requests for c in r.candidates]
    join = ResultJoin(run_id, iteration, "rollout", version.id, expected)
    calls = {k: ([by_group[g] for g in ids], contract, version) for k, ids in enumerate(shards) if ids}
    served: dict[str, int] = {}
    for k, samples in group.map_shards("generate", calls, timeout_s=timeout_s).items():
        for s in samples:
            key = ResultKey(run_id, iteration, s.sample_id, "rollout", s.policy_version.id)
            if join.offer(key, 0, s):
                served[s.sample_id] = k
    results = join.results()  # raises MissingResultsError naming the ids
    return [results[i] for i in expected], {**join.metrics(), "served_by": served}


def sync_weights(group: WorkerGroup, state: Mapping, manifest, timeout_s: float | None = None) -> PolicyVersion:
    """Every replica loads and verifies `manifest`; returns its version once all serve it."""
    group.call("load", group.put(dict(state)), manifest, timeout_s=timeout_s)  # put once, not per replica
    held = group.attr("version")
    wrong = [k for k, v in enumerate(held) if v != manifest.version]
    if wrong:
        raise ReplicaVersionError(f"rollout replicas {wrong} serve {held[wrong[0]]}, not {manifest.version}")
    return manifest.version
