"""The stage watchdog: every driver stage runs under a deadline (`run.stage_timeout_s`, 0 =
none), a timer thread armed when the stage starts and cancelled when it ends.

A stage that hangs in this process cannot be pre-empted safely, so on expiry the watchdog writes
the failure (stage, role, worker, iteration, version) to stderr and to `failures.jsonl` in the
run folder, kills this process's children (reward scorers, a local Ray) and ends the process
with exit status STAGE_TIMEOUT_EXIT: nothing after the last committed checkpoint is kept, and
`resume=auto` continues from it exactly. Work in other processes has its own deadlines (reward
pool, Ray calls); this one bounds the driver's own waits on top of them."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

STAGE_TIMEOUT_EXIT = 4   # exit status of a process ended by the stage watchdog


class Watchdog:
    def __init__(self, timeout_s: float, run_dir: Path | None = None):
        self.timeout_s, self.run_dir = timeout_s, run_dir

    @contextmanager
    def guard(self, stage: str, role: str, worker: str, iteration: int, version: str):
        """The deadline of one stage: armed on entry, cancelled on exit however it exits."""
        if not self.timeout_s:
            yield
            return
        failure = {"stage": stage, "role": role, "worker": worker, "iteration": iteration,
                   "version": version, "timeout_s": self.timeout_s}
        timer = threading.Timer(self.timeout_s, _stage_timed_out, (failure, self.run_dir))
        timer.daemon = True   # never keeps a finished process alive
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def _stage_timed_out(failure: dict, folder: Path | None) -> None:
    """Watchdog expiry (on the timer thread): name the stage, record it, end the process."""
    f = failure
    message = (f"sealrl: error: stage {f['stage']} (role {f['role']}, worker {f['worker']}, iteration "
               f"{f['iteration']}, policy version {f['version'] or '-'}) did not finish within "
               f"{f['timeout_s']:g} s (run.stage_timeout_s); exiting with status {STAGE_TIMEOUT_EXIT}, "
               f"resume=auto continues from the last committed checkpoint")
    try:
        print(message, file=sys.stderr, flush=True)
        if folder is not None:
            record_failure(folder, f, message)
    finally:
        _kill_children()              # e.g. a reward worker hung in its scorer: no orphan left
        os._exit(STAGE_TIMEOUT_EXIT)   # the hung main thread cannot be unwound; the OS frees the rest


def record_failure(folder: Path, failure: dict, message: str) -> None:
    """Append one failure to `failures.jsonl` in the run folder, durably (the process may end next)."""
    with open(folder / "failures.jsonl", "a") as out:
        out.write(json.dumps({**failure, "time": time.time(), "message": message}) + "\n")
        out.flush()
        os.fsync(out.fileno())


def _kill_children() -> None:
    """SIGKILL every direct child process (Linux /proc; elsewhere nothing is found)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):   # exited while we looked
            continue


def watch_ray_head(folder: Path, grace_s: float, period_s: float = 1.0):
    """When this process is attached to Ray: a daemon thread that probes the head's GCS port
    every `period_s`; once it has not answered for `grace_s` (the head node is gone; Ray's own
    client would abort the process after 60 s with only its own message), the loss is named on
    stderr and in failures.jsonl, this process's children are killed and it exits with status
    2. resume=auto, on a restarted cluster or with placement.backend=local, continues from the
    last committed checkpoint. Returns the function that stops the watch."""
    import socket

    import ray
    if not ray.is_initialized():
        return lambda: None
    address = ray.get_runtime_context().gcs_address
    host, _, port = address.rpartition(":")
    stop = threading.Event()

    def probe() -> None:
        down_since = None
        while not stop.wait(period_s):
            try:
                socket.create_connection((host, int(port)), timeout=period_s).close()
                down_since = None
                continue
            except OSError as e:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since < grace_s:
                    continue
                reason = f"{type(e).__name__}: {e}"
            message = (f"sealrl: error: the Ray head at {address} is lost: its GCS has not answered for "
                       f"{grace_s:g} s (placement.head_grace_s; {reason}); exiting with status 2, resume=auto "
                       "continues from the last committed checkpoint once a cluster is back (or with "
                       "placement.backend=local)")
            try:
                print(message, file=sys.stderr, flush=True)
                record_failure(folder, {"stage": "-", "role": "ray_head", "worker": 0, "address": address}, message)
            finally:
                _kill_children()
                os._exit(2)

    threading.Thread(target=probe, name="sealrl-ray-head", daemon=True).start()
    return stop.set

