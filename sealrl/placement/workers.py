"""Worker groups: N copies of one role, in-process or as Ray actors, behind one interface.

    group.call(method, *args)          the same call on every worker; results in worker order
    group.map_shards(method, shards)   worker k gets shards[k] (an args tuple); dict k -> result
    group.attr(name)                   an attribute of every worker (e.g. the active version)
    group.settle(method, shards)       like map_shards, but k -> result or WorkerError (waits for all;
                                       on_result(k, result) as each arrives)
    group.put(value)                   share a large argument once (Ray object store)
    group.restart(k)                   (Ray) replace worker k by a fresh one from the factory
    group.close()

The driver never sees the difference: a role object (sealrl.roles.*) is built from a picklable
factory (e.g. `functools.partial(Rollout, model, tokenizer)`) either here or inside a Ray
actor. Every remote wait has a deadline; a failure or a timeout raises WorkerError naming the
role, the worker and the method, with the worker's own exception as `cause`; `lost` says the
worker itself is gone (its process died, or it missed the deadline and must be replaced).

Ray resources: `pools_from_config` reads pools such as
    {"train": {"roles": ["actor", "rollout"], "num_workers": 2, "num_cpus_per_worker": 1},
     "reward": {"roles": ["reward"], "num_workers": 1}}
A pool is one Ray placement group of `num_workers` bundles; worker k of every role of the pool
runs on bundle k (colocated: they time-share that bundle's CPUs/GPUs, each asking for an equal
fraction). A pool with one role is a standalone pool. `ray` is imported only in this module.
"""
from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from sealrl.config import UserError
from sealrl.seams.host import RemoteCallError, type_name_of
from sealrl.sync.remote import RemoteState


class WorkerError(RuntimeError):
    """A call on a worker failed or missed its deadline. `cause` is the worker's exception
    (a RemoteCallError carrying its type name and attributes when it could not be pickled);
    `lost` is True when the worker is unusable (process died, or late: its task still runs)."""

    def __init__(self, role: str, worker: int, method: str, reason: str, cause: BaseException | None = None,
                 lost: bool = False):
        super().__init__(f"role {role} worker {worker}: {method}: {reason}")
        self.role, self.worker, self.method, self.reason = role, worker, method, reason
        self.cause, self.lost = cause, lost

    def __reduce__(self):
        return type(self), (self.role, self.worker, self.method, self.reason, self.cause, self.lost)


class WorkerGroup(Protocol):
    role: str
    num_workers: int

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list: ...
    def map_shards(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None) -> dict: ...
    def settle(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None,
               on_result: Callable[[int, Any], None] | None = None) -> dict: ...
    def attr(self, name: str, timeout_s: float | None = None) -> list: ...
    def put(self, value: Any) -> Any: ...
    def close(self) -> None: ...


class LocalWorkerGroup:
    """Role objects in this process; calls run one after another (the `placement=local` path)."""

    def __init__(self, role: str, workers: list) -> None:
        self.role, self.workers, self.num_workers = role, list(workers), len(workers)

    def _run(self, k: int, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            return getattr(self.workers[k], method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised with the role and worker named
            raise WorkerError(self.role, k, method, f"{type(e).__name__}: {e}", e) from e

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        return [self._run(k, method, args, kwargs) for k in range(self.num_workers)]

    def map_shards(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None) -> dict:
        return {k: self._run(k, method, tuple(a), {}) for k, a in sorted(shards.items())}

    def settle(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None,
               on_result: Callable[[int, Any], None] | None = None) -> dict:
        out: dict = {}
        for k, a in sorted(shards.items()):
            try:
                out[k] = self._run(k, method, tuple(a), {})
            except WorkerError as e:
                out[k] = e
            if on_result is not None:
                on_result(k, out[k])
        return out

    def attr(self, name: str, timeout_s: float | None = None) -> list:
        return [getattr(w, name) for w in self.workers]

    def put(self, value: Any) -> Any:
        return value

    def close(self) -> None:
        self.workers = []


# ---- Ray ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class PoolSpec:
    """One resource pool: `num_workers` bundles shared by the pool's roles."""

    name: str
    """pool name (config key)"""
    roles: tuple[str, ...]
    """roles whose worker k runs on bundle k of this pool"""
    num_workers: int = 1
    """bundles (and workers per role)"""
    num_cpus_per_worker: float = 1.0
    """CPUs of one bundle"""
    num_gpus_per_worker: float = 0.0
    """GPUs of one bundle"""
    resources: Mapping[str, float] = field(default_factory=dict)
    """custom Ray resources of one bundle (a node's `ray start --resources`): where it may go"""
    strategy: str = "PACK"
    """Ray placement-group strategy: PACK (few nodes) or SPREAD (as many nodes as it can)"""

    def __post_init__(self) -> None:
        if not self.roles:
            raise ValueError(f"pool {self.name}: roles must not be empty")
        if self.num_workers < 1:
            raise ValueError(f"pool {self.name}: num_workers must be >= 1, got {self.num_workers!r}")
        if self.num_cpus_per_worker <= 0 or self.num_gpus_per_worker < 0:
            raise ValueError(f"pool {self.name}: num_cpus_per_worker must be > 0 and num_gpus_per_worker"
                             f" >= 0, got {self.num_cpus_per_worker!r}, {self.num_gpus_per_worker!r}")


def pools_from_config(pools: Mapping[str, Mapping[str, Any]]) -> dict[str, PoolSpec]:
    """role -> its PoolSpec; a role in two pools or an unknown key is an error."""
    allowed = set(PoolSpec.__dataclass_fields__) - {"name"}
    out: dict[str, PoolSpec] = {}
    for name, d in pools.items():
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"pool {name}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        spec = PoolSpec(name=name, **{**d, "roles": tuple(d.get("roles", ()))})
        for role in spec.roles:
            if role in out:
                raise ValueError(f"role {role} is in pools {out[role].name} and {name}")
            out[role] = spec
    return out


_LOCAL_RAY = False   # init_ray started a local Ray (not attached to a cluster)
LOCAL_GRACE_S = 20.0  # how long a pool waits on the local Ray for resources a removed pool frees


def init_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
    """A local Ray started by sealrl (address None: `num_cpus`/`num_gpus` cap it, no dashboard,
    a 256 MiB object store: experience and small models only) or a cluster started with
    `ray start --head` (address "auto" or host:port; its dashboard binds where `ray start
    --dashboard-host` said, localhost by default). Every node needs the same sealrl installed.
    RAY_ADDRESS (what `ray job submit` and KubeRay set) attaches like placement.address: the
    cluster's resources are its own, so num_cpus/num_gpus are not passed."""
    import ray
    global _LOCAL_RAY
    _LOCAL_RAY = False
    if address is None and os.environ.get("RAY_ADDRESS"):
        address, num_cpus, num_gpus = os.environ["RAY_ADDRESS"], None, None
        print(f"sealrl: attaching to the Ray cluster at RAY_ADDRESS={address}", file=sys.stderr, flush=True)
    if address is None:
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                 object_store_memory=256 * 2 ** 20)
        _LOCAL_RAY = True   # only this run places anything on it: what is not free now never will be
    else:
        if num_cpus is not None or num_gpus is not None:
            raise ValueError("init_ray: num_cpus/num_gpus are the cluster's own when an address is given")
        ray.init(address=address)


class PlacementError(UserError):
    """A pool asks for more than the cluster has, or than is free: one line naming both."""


class RayPool:
    """A created placement group for one PoolSpec (wait for it once, share it by its roles).
    A request past the cluster's total fails at once; one past what is free waits up to
    `timeout_s` on an attached cluster (other jobs may release it) and LOCAL_GRACE_S on the local
    Ray sealrl started, then fails: one line naming what was asked and what is there."""

    def __init__(self, spec: PoolSpec, timeout_s: float = 60.0) -> None:
        import ray
        from ray.util.placement_group import placement_group
        bundle = {"CPU": spec.num_cpus_per_worker, **spec.resources}
        if spec.num_gpus_per_worker:
            bundle["GPU"] = spec.num_gpus_per_worker
        self.spec = spec
        asked = {k: v * spec.num_workers for k, v in bundle.items()}
        total = ray.cluster_resources()
        if any(v > total.get(k, 0.0) + 1e-9 for k, v in asked.items()):
            raise PlacementError(_placement_line(spec, bundle, asked, total, ray.available_resources(),
                                                 "cannot be placed"))
        self.pg = placement_group([dict(bundle) for _ in range(spec.num_workers)], strategy=spec.strategy)
        # the local Ray holds only this run's pools: what a short grace (Ray frees a removed
        # group's resources asynchronously) does not free, nothing will
        wait_s = min(timeout_s, LOCAL_GRACE_S) if _LOCAL_RAY else timeout_s
        ready, _ = ray.wait([self.pg.ready()], timeout=wait_s)
        if not ready:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.pg)
            raise PlacementError(_placement_line(spec, bundle, asked, total, ray.available_resources(),
                                                 f"was not free within {wait_s:g} s"))

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(self.pg)


def _placement_line(spec: PoolSpec, bundle: dict, asked: dict, total: dict, free: dict, what: str) -> str:
    have = ", ".join(f"{k} {total.get(k, 0.0):g} in all, {free.get(k, 0.0):g} free" for k in asked)
    return (f"Ray pool {spec.name!r} ({', '.join(spec.roles)}): {spec.num_workers} x {bundle} = {asked} {what}; "
            f"the cluster has {have}. Lower placement.actor_ranks / rollout_replicas / cpus_per_replica / "
            "cpus_per_rank, check placement.replica_resources / rank_resources against the nodes' "
            "resources, or raise placement.num_cpus (local Ray) or add nodes")


class _RoleHost:
    """Inside a Ray actor: one role object built from its factory."""

    def __init__(self, factory: Callable[[], Any], threads: int) -> None:
        import torch
        torch.set_num_threads(threads)
        self.role = factory()

    def call(self, method: str, *args, **kwargs) -> Any:
        try:
            return getattr(self.role, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised in a form the driver can unpickle
            raise RemoteCallError.portable(e) from None

    def attr(self, name: str) -> Any:
        return getattr(self.role, name)

    def host_info(self) -> dict:
        return host_info()

    def rendezvous(self) -> str:
        """tcp://<this node's address>:<a free port>, for rank 0 of a process group."""
        import socket

        import ray
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:   # a free port on this node, for the group's rendezvous
            sock.bind((host, 0))
            return f"tcp://{host}:{sock.getsockname()[1]}"

    def join_process_group(self, init_method: str, rank: int, world_size: int, backend: str) -> int:
        import torch
        import torch.distributed as dist
        if backend == "nccl":  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU(s)
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        return dist.get_rank()


def host_info() -> dict:
    """Where this process runs and what it runs: Ray node, host, pid, torch and sealrl (a digest
    of the package's source files, so two checkouts of one version number still differ)."""
    import socket

    import ray
    import torch
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    return {"node_id": node, "host": socket.gethostname(), "pid": os.getpid(), "torch": torch.__version__,
            "sealrl": _code_digest()}


@functools.cache
def _code_digest() -> str:
    """sha256 of sealrl's source files (path and bytes), once per process."""
    import hashlib
    from pathlib import Path

    import sealrl
    root = Path(sealrl.__file__).parent
    code = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        code.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return code.hexdigest()[:16]


# Where every Ray worker of this process's run was placed, role by role (trainer/setup.py writes
# it to the run folder as placement.json; a replaced worker's entry is replaced).
HOSTS: dict[tuple[str, int], dict] = {}


class RayWorkerGroup:
    """`pool.spec.num_workers` Ray actors, each hosting `factory()`; worker k on bundle k. A
    worker whose torch or sealrl differ from the driver's is refused (PlacementError, one line).
    `concurrency` > 1: each actor runs that many calls at once, in threads (a rollout replica
    stages a version while it generates; the role must be safe for it), in no set order."""

    def __init__(self, role: str, factory: Callable[[], Any], pool: RayPool, timeout_s: float = 300.0,
                 threads: int = 1, concurrency: int = 1) -> None:
        self.role, self.num_workers, self.timeout_s = role, pool.spec.num_workers, timeout_s
        import ray
        self._host, self._factory, self._pool, self._threads = ray.remote(_RoleHost), factory, pool, threads
        self._concurrency = concurrency
        self.restarts = 0
        self.actors = [self._start(k) for k in range(self.num_workers)]
        self.attr("__class__", timeout_s=timeout_s)  # waits until every factory has run
        self._check_hosts(range(self.num_workers), timeout_s)

    def _check_hosts(self, workers, timeout_s: float | None) -> None:
        infos = self._collect("host_info", {k: self.actors[k].host_info.remote() for k in workers}, timeout_s)
        mine = host_info()
        for k, info in sorted(infos.items()):
            HOSTS[(self.role, k)] = {"role": self.role, "worker": k, **info}
            for key in ("torch", "sealrl"):
                if info[key] != mine[key]:
                    raise PlacementError(f"{self.role} worker {k} on host {info['host']} (node {info['node_id'][:12]}) "
                                         f"runs {key} {info[key]}, the driver {mine[key]}: install the same sealrl "
                                         "and torch on every node")

    def _start(self, k: int):
        """A new actor for worker k on bundle k; colocated roles split the bundle equally."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        spec, share = self._pool.spec, len(self._pool.spec.roles)
        return self._host.options(
            num_cpus=spec.num_cpus_per_worker / share, num_gpus=spec.num_gpus_per_worker / share,
            max_restarts=0, max_concurrency=self._concurrency, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pool.pg, placement_group_bundle_index=k)).remote(self._factory, self._threads)

    def restart(self, k: int, timeout_s: float | None = None) -> None:
        """Kill worker k (dead, or late with a task still running) and start a fresh one from
        the factory on the same bundle; returns once the factory has run. A replacement that
        dies at start (its bundle was on a node that is gone, which Ray notices only after its
        health checks) is started again, with growing pauses, until `timeout_s`: Ray then moves
        the bundle to a live node with room, or the last failure is raised. The caller brings
        its state back (e.g. a rollout replica is synced to the active version, verified)."""
        import ray
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        pause = 1.0
        while True:
            self.kill(k)
            self.actors[k] = self._start(k)
            self.restarts += 1
            try:
                self._collect("__init__", {k: self.actors[k].attr.remote("__class__")},
                              max(1.0, deadline - time.monotonic()))
                break
            except WorkerError as e:
                # a lost node's bundle takes the new actor down with it until Ray has marked the
                # node dead (its health checks, seconds) and moved the bundle to a live node
                if not isinstance(e.cause, ray.exceptions.RayActorError) or time.monotonic() + pause >= deadline:
                    raise
                print(f"sealrl: {self.role} worker {k}: its replacement died at start ({e.reason[:120]}); "
                      f"starting another in {pause:g} s", file=sys.stderr, flush=True)
                time.sleep(pause)
                pause = min(2 * pause, 10.0)
        self._check_hosts([k], timeout_s)

    def kill(self, k: int) -> None:
        """End worker k's process at once, as a lost node would (fault drills); its next call
        fails as `lost`."""
        import ray
        ray.kill(self.actors[k], no_restart=True)

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list:
        refs = {k: a.call.remote(method, *args, **kwargs) for k, a in enumerate(self.actors)}
        out = self._collect(method, refs, timeout_s)
        return [out[k] for k in range(self.num_workers)]

    def map_shards(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None) -> dict:
        refs = {k: self.actors[k].call.remote(method, *args) for k, args in sorted(shards.items())}
        return self._collect(method, refs, timeout_s)

    def settle(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None,
               on_result: Callable[[int, Any], None] | None = None) -> dict:
        refs = {k: self.actors[k].call.remote(method, *args) for k, args in sorted(shards.items())}
        return self._collect(method, refs, timeout_s, settle=True, on_result=on_result)

    def attr(self, name: str, timeout_s: float | None = None) -> list:
        out = self._collect(name, {k: a.attr.remote(name) for k, a in enumerate(self.actors)}, timeout_s)
        return [out[k] for k in range(self.num_workers)]

    def init_process_group(self, backend: str = "gloo", timeout_s: float | None = None) -> None:
        """Join the workers in one torch.distributed group (rank = worker index), rendezvous at
        worker 0's node; every rank waits in init until all have joined."""
        init_method = self._collect("rendezvous", {0: self.actors[0].rendezvous.remote()}, timeout_s)[0]
        refs = {k: a.join_process_group.remote(init_method, k, self.num_workers, backend)
                for k, a in enumerate(self.actors)}
        self._collect("join_process_group", refs, timeout_s)

    def put(self, value: Any) -> Any:
        import ray
        if isinstance(value, RemoteState):   # already in the object store (a rank put it there)
            return value.ref
        return ray.put(value)  # an ObjectRef given as a top-level argument arrives resolved

    def _collect(self, method: str, refs: dict, timeout_s: float | None, settle: bool = False,
                 on_result: Callable[[int, Any], None] | None = None) -> dict:
        """Wait for every ref until one deadline; raise for the first worker that failed or is
        late (settle=True: wait for all, k -> result or WorkerError; `on_result(k, that)` as each
        worker's arrives, in the order they finish, not for late ones). A late task keeps running
        on its actor (Ray cannot stop it safely): later calls queue behind it, so a timed-out
        worker is `lost` (restart it, or close and rebuild the group)."""
        import ray
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        by_ref = {r: k for k, r in refs.items()}
        pending, out = list(refs.values()), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = sorted(by_ref[r] for r in pending)
                errors = {k: WorkerError(self.role, k, method, f"no result within {timeout}s (workers {late} "
                                         "pending)", lost=True) for k in late}
                if not settle:
                    raise errors[late[0]]
                out.update(errors)
                break
            k = by_ref[done[0]]
            try:
                out[k] = ray.get(done[0])
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                out[k] = WorkerError(self.role, k, method, f"{type_name_of(cause)}: {cause}", cause)
            except ray.exceptions.RayActorError as e:
                died = " ".join(str(e).split())   # Ray's message spans lines: one line here
                out[k] = WorkerError(self.role, k, method, f"the worker's process died: {died}", e, lost=True)
            if isinstance(out[k], WorkerError) and not settle:
                raise out[k] from out[k].cause
            if on_result is not None:
                on_result(k, out[k])
        return out

    def close(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a)
        self.actors = []
