"""The iteration state machine of DESIGN section 1, and the stage timeline.

A transition is legal only from the phase before it; anything else is a bug in the driver and
raises. Stages (timed spans inside a phase) go to `trace.json` in the Chrome trace format
(opens in Perfetto) with iteration, role and policy version.
"""
from __future__ import annotations

import enum
import json
import os
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


class StateMachine:
    def __init__(self, trace_path: Path | None = None):
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
        """Time a stage; its duration goes to `stage_seconds` and to the trace."""
        start = self._now()
        t = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            dt = end - t
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + dt
            self.stage_spans.append((name, t, end))
            self._events.append({"name": name, "cat": role, "ph": "X", "ts": start, "dur": dt * 1e6,
                                 "pid": 0, "tid": role,
                                 "args": {"iteration": self.iteration, "role": role, "version": self.version}})

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
