"""Run a function on N local processes joined in one torch.distributed group (gloo on CPU), so
that the production data-parallel ranks can be tested without Ray."""
from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, backend, fn, args, results) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
            buf = io.BytesIO()  # plain bytes: a tensor sent through the queue would live in
            torch.save(value, buf)  # shared memory that vanishes when this process exits
            results.put((rank, "ok", buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, "error", traceback.format_exc()))


def launch(fn: Callable, world_size: int, *args, timeout_s: float = 120.0,
           backend: str | None = None) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes joined in one
    process group on 127.0.0.1; returns the results in rank order. `fn` and `args` must be
    picklable (module-level). Waits at most `timeout_s` in all; a failure or a timeout kills
    the processes started here and raises naming the rank."""
    import torch.multiprocessing as mp

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead:
                    raise RuntimeError(f"data-parallel rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} and no result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"data-parallel ranks {missing} gave no result within {timeout_s}s") from None
                continue
            if status == "error":
                raise RuntimeError(f"data-parallel rank {rank} failed:\n{value}")
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)  # our own children's bytes
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [out[r] for r in range(world_size)]
