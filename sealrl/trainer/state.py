"""The iteration state machine of DESIGN section 1, and the stage timeline.

A transition is legal only from the phase before it; anything else is a bug in the driver and
raises. Stages (timed spans inside a phase) go to `trace.json` in the Chrome trace format
(opens in Perfetto) with iteration, role and policy version.

Every stage runs under a deadline (`stage_timeout_s`, 0 = none): a watchdog thread armed when
the stage starts and cancelled when it ends. A stage that hangs in this process cannot be
pre-empted safely, so on expiry the watchdog writes the failure (stage, role, worker process,
iteration, version) to stderr and to `failures.jsonl` in the run folder, kills this process's
children (reward workers, a local Ray) and ends the process with exit status
STAGE_TIMEOUT_EXIT: nothing after the last committed checkpoint is kept, and `resume=auto`
continues from it exactly. Work in other processes has its own deadlines (reward pool, Ray
calls); this one bounds the driver's own waits on top of them.
"""
from __future__ import annotations

import enum
import json
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path


class Phase(str, enum.Enum):
    ACTOR_COMMITTED = "ACTOR_COMMITTED"
    EXPORTING = "EXPORTING"
    ROLLOUT_LOADING = "ROLLOUT_LOADING"
    ROLLOUT_READY = "ROLLOUT_READY"
    GENERATING = "GENERATING"
    EXPERIENCE_SEALED = "EXPERIENCE_SEALED"
    UPDATING_FROM = "UPDATING_FROM"


_ORDER = list(Phase)
# ACTOR_COMMITTED(v+1) follows UPDATING_FROM(v); the cycle then repeats.
_NEXT = {p: _ORDER[(i + 1) % len(_ORDER)] for i, p in enumerate(_ORDER)}


class IllegalTransition(RuntimeError):
    pass


STAGE_TIMEOUT_EXIT = 4   # exit status of a process ended by the stage watchdog


class StateMachine:
    def __init__(self, trace_path: Path | None = None, stage_timeout_s: float = 0.0,
                 workers: dict[str, str] | None = None):
        self.stage_timeout_s = stage_timeout_s
        # role -> the worker(s) doing its stages (Roles.workers()); unnamed roles run in this process
        self.workers = dict(workers or {})
        self.phase = Phase.ACTOR_COMMITTED
        self.version = ""
        self.iteration = 0
        self._trace_path = trace_path
        self._events: list[dict] = []
        self._t0 = time.perf_counter()
        self.stage_seconds: dict[str, float] = {}
        # (stage, start, end) in time.perf_counter() seconds, this iteration, in end order:
        # the gaps between stages are the queue times of docs/metrics.md.
        self.stage_spans: list[tuple[str, float, float]] = []

    def to(self, phase: Phase, version: str) -> None:
        if _NEXT[self.phase] is not phase:
            raise IllegalTransition(f"{self.phase.value}({self.version}) -> {phase.value}({version}) "
                                    f"is not a transition of the iteration state machine")
        self.phase, self.version = phase, version
        self._events.append({"name": phase.value, "ph": "i", "s": "g", "ts": self._now(),
                             "pid": 0, "tid": 0, "args": {"iteration": self.iteration, "version": version}})

    @contextmanager
    def stage(self, name: str, role: str):
        """Time a stage under the watchdog; its duration goes to `stage_seconds` and to the trace."""
        start = self._now()
        t = time.perf_counter()
        watchdog = self._arm(name, role)
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.cancel()
            end = time.perf_counter()
            dt = end - t
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + dt
            self.stage_spans.append((name, t, end))
            self._events.append({"name": name, "cat": role, "ph": "X", "ts": start, "dur": dt * 1e6,
                                 "pid": 0, "tid": role,
                                 "args": {"iteration": self.iteration, "role": role, "worker": self.worker(role),
                                          "version": self.version}})

    def worker(self, role: str) -> str:
        return self.workers.get(role, f"pid {os.getpid()}")

    def _arm(self, name: str, role: str) -> threading.Timer | None:
        if not self.stage_timeout_s:
            return None
        failure = {"stage": name, "role": role, "worker": self.worker(role), "iteration": self.iteration,
                   "version": self.version, "timeout_s": self.stage_timeout_s}
        folder = self._trace_path.parent if self._trace_path is not None else None
        timer = threading.Timer(self.stage_timeout_s, _stage_timed_out, (failure, folder))
        timer.daemon = True   # never keeps a finished process alive
        timer.start()
        return timer

    def start_iteration(self, iteration: int) -> None:
        self.iteration, self.stage_seconds, self.stage_spans = iteration, {}, []

    def _now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def flush(self) -> None:
        """Append this process's events to trace.json (kept valid JSON at every flush)."""
        if self._trace_path is None or not self._events:
            return
        old = []
        if self._trace_path.is_file():
            old = json.loads(self._trace_path.read_text()).get("traceEvents", [])
        tmp = self._trace_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": old + self._events}))
        os.replace(tmp, self._trace_path)
        self._events = []


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
            with open(folder / "failures.jsonl", "a") as out:
                out.write(json.dumps({**f, "time": time.time(), "message": message}) + "\n")
                out.flush()
                os.fsync(out.fileno())
    finally:
        _kill_children()              # e.g. a reward worker hung in its scorer: no orphan left
        os._exit(STAGE_TIMEOUT_EXIT)   # the hung main thread cannot be unwound; the OS frees the rest


def _kill_children() -> None:
    """SIGKILL every direct child process (Linux /proc; elsewhere nothing is found)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):   # exited while we looked
            continue
