"""The rollout role in its own process, a client of the rollout seam (seams/rollout.py; its
capabilities are CLIENTS["process"]): the generation lane of an asynchronous
run (rollout.lane=process, trainer/pipeline.py) samples there while the actor trains here, each
process with its own torch threads and its own GIL.

Two pipes, one per direction of work, so neither waits on the other:

- calls: generate (and retain). The caller's thread waits for the answer; the child's main
  thread serves them one after another. A streamed generate (reward.stream) sends the rows
  that finished at each decode step ahead of its answer, handed on in the caller's thread.
- weights: load(state, manifest), and with LoRA once pin_base (the frozen base). The child's
  loader thread stages the state, verifies every
  checksum of the manifest (the two-phase sync of sealrl/sync: a corrupted tensor raises
  WeightSyncError naming it and activates nothing), then switches the active version. It runs
  while a generate call is in flight: that call keeps the version it was asked for (the engine
  retains the last `retain` versions), so a publication never waits for a generation to end
  and a generation never waits for a whole transfer (double buffering: the retained version
  samples while the next one loads).

The state crosses as torch.save bytes (a copy: nothing of the actor's memory is shared), the
factory that builds the role as plain-pickle bytes. `version` and `backend` are the child's
answers to the last load, kept here, so asking them never queues behind a generation.

Every wait polls the child: if it exits, or misses `timeout_s`, the call raises
GenerationProcessError naming the process, its exit code and the call; every later call
raises the same error (`failed`). A role's own exception (a bad request, WeightSyncError)
comes back as itself (or its RemoteCallError form) and the process serves on.
"""
from __future__ import annotations

import io
import os
import pickle
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp

from sealrl.experience import PolicyVersion
from sealrl.placement.workers import RemoteCallError
from sealrl.seams.rollout import CLIENTS


class GenerationProcessError(RuntimeError):
    """The generation process is gone or stuck: it exited, failed to start, or missed its deadline."""


class ProcessRollout:
    """A rollout role built by `factory` (picklable: e.g. functools.partial(Rollout, model,
    tokenizer)) in a spawned process that runs `threads` torch threads and serves `retain` versions."""

    capabilities = CLIENTS["process"].capabilities

    def __init__(self, factory, threads: int, retain: int = 1, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.failed: GenerationProcessError | None = None
        self.version: PolicyVersion | None = None
        self.backend: tuple[str, str] = ("none", "none")
        self._last: tuple[bytes, object] | None = None   # the last loaded state (bytes) and manifest
        self._call_lock, self._load_lock = threading.Lock(), threading.Lock()
        self._in_flight: str | None = None   # the call the process is serving (named if it dies)
        ctx = mp.get_context("spawn")
        self._calls, calls = ctx.Pipe()
        self._weights, weights = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, name="sealrl-generation", daemon=False,
                                 args=(pickle.dumps(factory), threads, retain, calls, weights))
        self._proc.start()
        calls.close()
        weights.close()
        self.pid = self._proc.pid
        try:
            self._answer(self._calls, "start", max(timeout_s, 120.0))   # imports torch: slow on a busy machine
        except BaseException:
            self.close()
            raise

    # ---- the rollout client (seams/rollout.py) ------------------------------------------------
    def generate(self, requests, contract, version, stream=None):
        """`stream(samples)`: the rows that finished at a decode step, sent over the calls pipe as
        they finish (before the answer) and handed on here, in the calling thread."""
        if stream is None:
            return self._call("generate", requests, contract, version)
        return self._call("generate_streamed", requests, contract, version, stream=stream)

    def generate_switching(self, requests, contract, version, plan=None, resolve=None, stream=None):
        """rollout.partial=switch: the switch happens there, on the loads it receives meanwhile;
        a replay's `plan` names the recorded versions themselves, waited for there (`resolve`,
        a function of this process, cannot cross)."""
        if resolve is not None:
            raise ValueError("generate_switching in the generation process: the plan's keys must be the "
                             "versions themselves (a resolve function cannot cross processes)")
        if stream is None:
            return self._call("generate_switching", requests, contract, version, plan)
        return self._call("generate_switching_streamed", requests, contract, version, plan, stream=stream)

    def pin_base(self, state, manifest) -> str:
        """LoRA: the frozen base, sent once over the weights pipe and verified there; every later
        version is an adapter the child merges into it. Returns the base's hash."""
        with self._load_lock:
            self._alive("pin_base")
            self._send(self._weights, "pin_base", _bytes(state), manifest)
            return self._answer(self._weights, f"pin_base {manifest.version}")

    def retain(self, versions: int) -> None:
        self._call("retain", versions)

    def load(self, state, manifest) -> PolicyVersion:
        """Stage, verify and activate in the child (which may be generating meanwhile)."""
        data = _bytes(state)
        with self._load_lock:
            self._alive("load")
            self._send(self._weights, "load", data, manifest)
            self.version, self.backend = self._answer(self._weights, f"load {manifest.version}")
        self._last = (data, manifest)
        return self.version

    def last_loaded(self) -> tuple[dict, object] | None:
        """The last state and manifest loaded (to bring another rollout to the same version)."""
        if self._last is None:
            return None
        return torch.load(io.BytesIO(self._last[0]), weights_only=True), self._last[1]

    def take_served(self) -> list[dict]:
        return []

    def take_recoveries(self) -> list[float]:
        return []

    def take_engine_stats(self) -> dict[str, float]:
        return self._call("take_engine_stats")   # the child's meter

    def close(self) -> None:
        """Stop the process (a polite stop, then terminate, then kill)."""
        for conn in (self._calls, self._weights):
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        for conn in (self._calls, self._weights):
            conn.close()

    # ---- waits with a deadline -------------------------------------------------------------
    def _call(self, method: str, *args, stream=None):
        with self._call_lock:
            self._alive(method)
            self._in_flight = method
            try:
                self._send(self._calls, method, *args)
                return self._answer(self._calls, method, stream=stream)
            finally:
                self._in_flight = None

    def _alive(self, what: str) -> None:
        if self.failed is not None:
            raise self.failed
        if not self._proc.is_alive():
            self._fail(f"exited with code {self._proc.exitcode} before {what}")

    def _send(self, conn: Connection, method: str, *args) -> None:
        try:
            conn.send((method, args))
        except (OSError, ValueError) as e:
            if self._exit_code() is not None:   # a broken pipe: the process is gone
                self._fail(f"exited with code {self._proc.exitcode} during {self._in_flight or method}")
            self._fail(f"cannot be reached for {method} ({type(e).__name__}: {e})")

    def _exit_code(self, wait_s: float = 5.0) -> int | None:
        """The process's exit code once it has exited (within `wait_s`), else None. The other
        pipe's waiter may be the one reaping it, so this polls rather than joins once."""
        deadline = time.monotonic() + wait_s
        while self._proc.exitcode is None and time.monotonic() < deadline:
            self._proc.join(timeout=0.1)
        return self._proc.exitcode

    def _answer(self, conn: Connection, what: str, timeout_s: float | None = None, stream=None):
        """The call's answer within `timeout_s`; streamed rows before it go to `stream`."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            while not conn.poll(0.1):
                if not self._proc.is_alive():
                    self._proc.join()
                    self._fail(f"exited with code {self._proc.exitcode} during {self._in_flight or what}")
                if time.monotonic() > deadline:
                    self._proc.kill()
                    self._proc.join()
                    self._fail(f"missed the deadline of {timeout_s:g} s (placement.timeout_s) during {what}; "
                               "it was stopped")
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self._fail(f"exited with code {self._exit_code()} during {self._in_flight or what}")
            if status == "stream" and stream is not None:
                stream(value)
                continue
            if status == "error":
                raise value
            return value

    def _fail(self, reason: str):
        """Raise the process's failure: the first one found (by either pipe's caller) is kept, so
        every later call, and the training lane, name the same."""
        if self.failed is None:
            self.failed = GenerationProcessError(f"generation process (pid {self.pid}) {reason}")
        raise self.failed


def _bytes(state) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


# ---- the child ----------------------------------------------------------------------------

def _serve(factory: bytes, threads: int, retain: int, calls: Connection, weights: Connection) -> None:
    """The generation process: build the role, answer `start`, load weights on a thread,
    serve calls until told to stop or the parent's end closes. Episode tool workers are closed."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)   # as the driver's process
    try:
        role = pickle.loads(factory)()
        role.retain(retain)
    except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
        calls.send(("error", RemoteCallError.portable(e)))
        return
    calls.send(("ok", os.getpid()))
    threading.Thread(target=_load_loop, args=(role, weights), name="sealrl-weights", daemon=True).start()
    try:
        _loop(calls, lambda method, args: _serve_call(role, calls, method, args))
    finally:
        role.close()   # its episodes' tool worker
    os._exit(0)   # every answer is sent: skip the interpreter's slow teardown (the loader thread, torch)


def _serve_call(role, calls: Connection, method: str, args: tuple):
    """One call on the role; a streamed generate (switching or not) sends each step's finished
    rows ahead of its answer."""
    if not method.endswith("_streamed"):
        return getattr(role, method)(*args)

    def send(samples) -> None:
        if samples:
            calls.send(("stream", samples))
    return getattr(role, method.removesuffix("_streamed"))(*args, stream=send)


def _load_loop(role, weights: Connection) -> None:
    def load(method, args):
        data, manifest = args
        state = torch.load(io.BytesIO(data), weights_only=True)
        if method == "pin_base":   # LoRA: the base later adapter versions merge into
            return role.pin_base(state, manifest)
        version = role.load(state, manifest)
        return version, role.backend
    _loop(weights, load)


def _loop(conn: Connection, handle) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            out = ("ok", handle(*msg))
        except Exception as e:  # noqa: BLE001 - the role's own error, raised in the parent
            out = ("error", RemoteCallError.portable(e))
        try:
            conn.send(out)
        except (OSError, ValueError):
            return
