"""A worker group whose workers are process hosts of this machine (seams/host.py), behind the
WorkerGroup interface of placement/workers.py (call, map_shards, settle, attr, put, restart,
kill, close). A RolloutPool over one such worker is the generation lane of rollout.lane=process:
the pool's two-phase verified loads, retained versions and replacement of a lost worker serve it
as they serve the Ray replicas, with no generation-process code of its own.

Each worker serves its role through `_Hosted`: the process's torch threads, deterministic
algorithms as in the driver's process, and arguments shared with `put` (torch.save bytes: a copy,
nothing of the caller's memory is shared) read back there. `concurrency` channels per worker run
that many calls at once (a rollout stages a version while it generates), like a Ray actor's
max_concurrency. A worker that is gone (exited, missed its deadline: then it is killed) raises
WorkerError with `lost` set, its cause the host's HostLostError naming the process and the call.
"""
from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from sealrl.placement.workers import WorkerError
from sealrl.seams.host import HostLostError, ProcessHost, type_name_of


class Shared:
    """A value `put` once and sent to workers as torch.save bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _read(value):
    import torch
    return torch.load(io.BytesIO(value.data), weights_only=True) if isinstance(value, Shared) else value


class _Hosted:
    """Inside a worker process: one role object built from its factory."""

    def __init__(self, factory: Callable[[], Any], threads: int) -> None:
        import torch
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True, warn_only=True)   # as the driver's process
        self.role = factory()

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.role, method)(*map(_read, args), **kwargs)

    def attr(self, name: str) -> Any:
        return getattr(self.role, name)

    def close(self) -> None:
        close = getattr(self.role, "close", None)
        if close is not None:
            close()


class ProcessWorkerGroup:
    """`num_workers` process hosts, each serving `factory()` with `threads` torch threads."""

    def __init__(self, role: str, factory: Callable[[], Any], num_workers: int = 1, timeout_s: float = 300.0,
                 threads: int = 1, concurrency: int = 2) -> None:
        self.role, self.num_workers, self.timeout_s = role, num_workers, timeout_s
        self._factory, self._concurrency = functools.partial(_Hosted, factory, threads), concurrency
        self.restarts = 0
        self.unreplaced: HostLostError | None = None   # a replacement that could not start
        self.actors: list[ProcessHost] = []   # the hosts (a pool tells a replaced worker by its handle)
        try:
            for k in range(num_workers):
                self.actors.append(self._start(k))
        except BaseException:
            self.close()
            raise

    def _start(self, k: int) -> ProcessHost:   # imports torch and builds the role: slow on a busy machine
        return ProcessHost(f"{self.role} worker {k}", self._factory, channels=self._concurrency,
                           startup_timeout_s=max(self.timeout_s, 120.0))

    @property
    def pids(self) -> list[int]:
        return [h.pid for h in self.actors]

    def _one(self, k: int, what: str, method: str, args: tuple, timeout_s: float | None) -> Any:
        try:
            return self.actors[k].call(what, method, *args, channel=None, during=method,
                                       timeout_s=self.timeout_s if timeout_s is None else timeout_s)
        except HostLostError as e:
            raise WorkerError(self.role, k, method, str(e), e, lost=True) from e
        except Exception as e:  # noqa: BLE001 - the role's own error, re-raised with role and worker named
            raise WorkerError(self.role, k, method, f"{type_name_of(e)}: {e}", e) from e

    def _each(self, what: str, method: str, shards: Mapping[int, tuple], timeout_s: float | None, settle: bool,
              on_result: Callable[[int, Any], None] | None = None) -> dict:
        """k -> result of each worker's call, run at once (threads); a WorkerError is raised
        (settle: kept as k's result, every call waited for); `on_result` as each arrives."""
        def run(k: int):
            try:
                return self._one(k, what, method, tuple(shards[k]), timeout_s)
            except WorkerError as e:
                if not settle:
                    raise
                return e
        out: dict = {}
        if not shards:
            return out
        if len(shards) == 1:   # the generation lane's pool of one: in the calling thread
            [(k, _)] = shards.items()
            out[k] = run(k)
            if on_result is not None:
                on_result(k, out[k])
            return out
        with ThreadPoolExecutor(max_workers=len(shards)) as pool:
            futures = {pool.submit(run, k): k for k in sorted(shards)}
            for done in as_completed(futures):
                out[futures[done]] = done.result()
                if on_result is not None:
                    on_result(futures[done], out[futures[done]])
        return out

    def call(self, method: str, *args, timeout_s: float | None = None) -> list:
        out = self._each("call", method, dict.fromkeys(range(self.num_workers), args), timeout_s, settle=False)
        return [out[k] for k in range(self.num_workers)]

    def map_shards(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None) -> dict:
        return self._each("call", method, shards, timeout_s, settle=False)

    def settle(self, method: str, shards: Mapping[int, tuple], timeout_s: float | None = None,
               on_result: Callable[[int, Any], None] | None = None) -> dict:
        return self._each("call", method, shards, timeout_s, settle=True, on_result=on_result)

    def attr(self, name: str, timeout_s: float | None = None) -> list:
        out = self._each("attr", name, {k: () for k in range(self.num_workers)}, timeout_s, settle=False)
        return [out[k] for k in range(self.num_workers)]

    def put(self, value: Any) -> Shared:
        import torch
        buf = io.BytesIO()
        torch.save(value, buf)
        return Shared(buf.getvalue())

    def restart(self, k: int, timeout_s: float | None = None) -> None:
        """A fresh worker k from the factory (the lost one killed); the caller brings its state
        back. One that cannot start is kept in `unreplaced` (and raised)."""
        try:
            self.actors[k] = self.actors[k].respawn()
        except HostLostError as e:
            self.unreplaced = e
            raise
        self.restarts += 1

    def kill(self, k: int) -> None:
        """End worker k's process at once (fault drills); its next call fails as `lost`."""
        self.actors[k].kill()

    def close(self) -> None:
        for host in self.actors:
            host.close()
        self.actors = []
