"""Dispatch role work to a worker group by id and join the results by sample id.

`generate_by_id`: GENERATING(v) over a pool of rollout replicas. Requests are split by group
id (sorted, contiguous ranges: experience.split_ids), so the split does not depend on the order
the driver built them in; each shard keeps that order, so a pool of one replica computes row
for row what the local rollout does. Results come back per worker and are joined by (sample id,
version id) (experience.join; the sample id names run and iteration). It consumes requests whose
samples all belong to version v; it waits for every replica's shard (one deadline,
WorkerGroup.timeout); a replica that answers with another version, twice for an id, or not at
all makes the join fail loudly. A replica
that is lost (its process died, or it missed the deadline) can be replaced (`replace(k)`:
a fresh replica synced to v, verified) and its shard sent again, unchanged: same requests,
same seeds, same version, a new join attempt, so nothing is duplicated or missing.

Weight sync, two phases (DESIGN section 5): EXPORTING(v) -> ROLLOUT_LOADING(v) on every
replica (`stage_all`: each one copies the shared state and verifies every checksum, keeping
its active version) -> ROLLOUT_READY(v) (`activate_all`: pointer switches, started only once
every replica verified). A verification failure on any replica discards the staged copies
everywhere and activates nothing anywhere; the error names the replica and the tensor
(WorkerError.cause is the WeightSyncError). Activation is a pointer assignment and fails
only if a replica's process is gone; such a replica is replaced and loads v itself.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sealrl.experience import Join, PolicyVersion, SamplingContract, sample_id, split_ids
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.placement.workers import WorkerError, WorkerGroup
from sealrl.sync.manifest import WeightManifest


class ReplicaVersionError(RuntimeError):
    """After a sync, the rollout replicas do not all serve the expected version."""


def generate_by_id(group: WorkerGroup, requests: list[GenerationRequest], contract: SamplingContract,
                   version: PolicyVersion, timeout_s: float | None = None,
                   replace: Callable[[int], None] | None = None, max_replacements: int = 1,
                   stream: Callable[[list[RolloutSample]], None] | None = None,
                   method: str = "generate", extra: tuple = ()) -> tuple[list[RolloutSample], dict]:
    """Samples of every requested candidate (in request, then candidate order, as the local
    Rollout returns them) and the join's metrics, incl. which replica served each id.
    A lost replica is replaced and its shard re-sent up to `max_replacements` times per call
    (only when `replace` is given); any other failure raises its WorkerError. `stream`: each
    replica's accepted samples are handed on as soon as its shard arrives, while the other
    replicas still generate (reward.stream on Ray: finished rows, a shard at a time).
    `method`, `extra`: the replica call and its arguments after (requests, contract, version):
    generate_switching with a replay's plan (rollout.partial=switch)."""
    by_group = {r.group_id: r for r in requests}
    if len(by_group) != len(requests):
        raise ValueError("generate_by_id: one request per group id (merge candidates first)")
    shards = [set(ids) for ids in split_ids(by_group, group.num_workers)]
    join = Join("rollout")
    # a shard's requests in the order given: a pool of one then batches its rows as the local
    # rollout does (on some CPUs a row's float32 log-probs depend on its place in the matmul)
    calls = {k: ([r for r in requests if r.group_id in ids], contract, version, *extra)
             for k, ids in enumerate(shards) if ids}
    attempt = dict.fromkeys(calls, 0)   # join attempt of each shard's ids
    for k, (reqs, *_) in calls.items():
        join.ask(_keys(reqs, version), 0)
    served: dict[str, int] = {}

    def accept(k: int, out) -> None:   # as each replica's shard arrives
        if isinstance(out, WorkerError):
            return
        fresh = [s for s in out if join.offer((s.sample_id, s.policy_version.id), attempt[k], s)]
        for s in fresh:
            served[s.sample_id] = k
        if stream is not None and fresh:
            stream(fresh)

    for round_ in range(max_replacements + 1):
        lost = []
        for k, out in sorted(group.settle(method, calls, timeout_s=timeout_s, on_result=accept).items()):
            if isinstance(out, WorkerError):
                if not (out.lost and replace is not None and round_ < max_replacements):
                    raise out
                lost.append(k)
        if not lost:
            break
        for k in lost:  # same shard, same seeds, same version, on a fresh replica
            replace(k)
            attempt[k] += 1
            join.ask(_keys(calls[k][0], version), attempt[k])
        calls = {k: calls[k] for k in lost}
    results = join.results()  # raises MissingResultsError naming the ids
    metrics = {f"placement/rollout_{k}": float(v) for k, v in join.counts.items()}
    metrics["placement/rollout_resent_shards"] = float(sum(attempt.values()))
    return [results[key] for key in _keys(requests, version)], {**metrics, "served_by": served}


def _keys(requests: list[GenerationRequest], version: PolicyVersion) -> list[tuple[str, str]]:
    """Join keys of the requested candidates, in request then candidate order."""
    return [(sample_id(r.group_id, c), version.id) for r in requests for c in r.candidates]


def stage_all(group: WorkerGroup, shared_state: Any, manifest: WeightManifest,
              timeout_s: float | None = None) -> dict[int, WorkerError]:
    """ROLLOUT_LOADING(v) on every replica; waits for all of them. Returns the failures by
    replica (empty: every replica verified v and holds it staged). On any failure, the
    replicas that did verify drop their staged copy: nothing can be activated."""
    everyone = {k: (shared_state, manifest) for k in range(group.num_workers)}
    outcomes = group.settle("stage", everyone, timeout_s=timeout_s)
    failed = {k: e for k, e in outcomes.items() if isinstance(e, WorkerError)}
    if failed:
        group.settle("discard_staged", {k: () for k in outcomes if k not in failed}, timeout_s=timeout_s)
    return failed


def activate_all(group: WorkerGroup, version: PolicyVersion, timeout_s: float | None = None,
                 replace: Callable[[int], None] | None = None) -> PolicyVersion:
    """ROLLOUT_READY(v) on every replica, after stage_all succeeded; a lost replica is
    replaced (when `replace` is given: it loads v itself). Every replica must then serve v."""
    outcomes = group.settle("activate", {k: (version,) for k in range(group.num_workers)}, timeout_s=timeout_s)
    for k, out in sorted(outcomes.items()):
        if isinstance(out, WorkerError):
            if not (out.lost and replace is not None):
                raise out
            replace(k)
    held = group.attr("version", timeout_s=timeout_s)
    wrong = [k for k, v in enumerate(held) if v != version]
    if wrong:
        raise ReplicaVersionError(f"rollout replicas {wrong} serve {held[wrong[0]]}, not {version}")
    return version


def replace_replica(group, k: int, held: list[tuple[Any, WeightManifest]], retain: int = 1,
                    timeout_s: float | None = None, base: tuple[Any, WeightManifest] | None = None) -> None:
    """A fresh replica k (group.restart: Ray groups) brought to the versions the others hold:
    it pins the LoRA `base` (shared state, manifest) if any, retains `retain` and loads each of
    `held` (shared state, manifest), oldest first, with a verified load (stage + activate),
    before it serves anything."""
    group.restart(k, timeout_s=timeout_s)
    if base is not None:
        group.map_shards("pin_base", {k: base}, timeout_s=timeout_s)
    if retain > 1:
        group.map_shards("retain", {k: (retain,)}, timeout_s=timeout_s)
    for shared, manifest in held:
        group.map_shards("load", {k: (shared, manifest)}, timeout_s=timeout_s)
