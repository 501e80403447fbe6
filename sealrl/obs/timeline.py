"""The stage timeline: `trace.json` (Chrome trace event format, opens in Perfetto or
chrome://tracing) and the per-iteration share of wall time each stage takes.

The synchronous loop runs its stages one after another, so the iteration's critical path is the
sum of its stages: a stage's share of `time/iteration_s` is what removing it would save. Time
not covered by a timed stage (driver bookkeeping, metrics, experience writes) is `other`.

With a generation lane (rollout.max_staleness >= 1) the lanes' stages overlap and their shares
can sum past 1. The critical path is then the training lane's: its own stages, and of the
generation lane's stages only the time the training lane spent waiting for them
(`critical_seconds`; `time/critical_share_<stage>` in docs/metrics.md)."""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from sealrl.obs import memory

REQUIRED_EVENT_KEYS = ("name", "ph", "ts", "pid", "tid")
_NOT_STAGES = ("time/iteration_s", "time/train_wall_s")


def stage_seconds(metrics_row: dict) -> dict[str, float]:
    """`time/<stage>_s` -> {stage: seconds}; totals and precomputed shares are not stages."""
    out = {}
    for key, value in metrics_row.items():
        if (key.startswith("time/") and key.endswith("_s") and key not in _NOT_STAGES
                and not key.startswith("time/share_") and isinstance(value, (int, float))):
            out[key[len("time/"):-len("_s")]] = float(value)
    return out


def stage_breakdown(metrics_row: dict) -> dict[str, float]:
    """{stage: seconds} plus `other` = iteration time not covered by a stage (clamped at 0); a
    row with critical-path shares (a generation lane) gives each stage's seconds on that path."""
    total = metrics_row.get("time/iteration_s")
    prefix = "time/critical_share_"
    critical = {k[len(prefix):]: v for k, v in metrics_row.items() if k.startswith(prefix)}
    if critical and isinstance(total, (int, float)):
        return {stage: share * total for stage, share in critical.items()}
    out = stage_seconds(metrics_row)
    if isinstance(total, (int, float)):
        out["other"] = max(0.0, total - sum(out.values()))
    return out


def stage_shares(metrics_row: dict) -> dict[str, float]:
    """{stage: time/<stage>_s / time/iteration_s} plus `other` = 1 - sum (clamped at 0: stages
    that overlap, as in asynchronous modes, can sum past 1). Empty when the row has no
    positive iteration time."""
    total = metrics_row.get("time/iteration_s")
    if not isinstance(total, (int, float)) or total <= 0:
        return {}
    shares = {stage: s / total for stage, s in stage_seconds(metrics_row).items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def critical_seconds(own: list[tuple[str, float, float]], lane: list[tuple[str, float, float]],
                     waits: list[tuple[float, float]]) -> dict[str, float]:
    """{stage: seconds on the training lane's critical path}: every `own` span (the training
    lane's stages) whole, and of each `lane` span (the generation lane's) the part that overlaps
    a wait of the training lane for it; spans are (stage, start, end) on one clock."""
    out: dict[str, float] = {}
    for name, start, end in own:
        out[name] = out.get(name, 0.0) + end - start
    for name, start, end in lane:
        waited = sum(max(0.0, min(end, w1) - max(start, w0)) for w0, w1 in waits)
        if waited > 0:
            out[name] = out.get(name, 0.0) + waited
    return out


def critical_shares(critical: dict[str, float], iteration_s: float) -> dict[str, float]:
    """`time/critical_share_<stage>` and `_other` (1 - their sum, clamped at 0) of an iteration."""
    if iteration_s <= 0:
        return {}
    out = {f"time/critical_share_{k}": v / iteration_s for k, v in critical.items()}
    out["time/critical_share_other"] = max(0.0, 1.0 - sum(out.values()))
    return out


def mean_stage_shares(rows: list[dict]) -> dict[str, float]:
    """Stage shares of the whole run: summed stage seconds over summed iteration seconds, so a
    slow iteration weighs more than a fast one. Sorted largest first."""
    total = sum(r["time/iteration_s"] for r in rows if isinstance(r.get("time/iteration_s"), (int, float)))
    summed: dict[str, float] = {}
    for r in rows:
        if isinstance(r.get("time/iteration_s"), (int, float)):
            for stage, s in stage_seconds(r).items():
                summed[stage] = summed.get(stage, 0.0) + s
    shares = stage_shares({"time/iteration_s": total, **{f"time/{k}_s": v for k, v in summed.items()}})
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def read_trace(path: Path) -> list[dict]:
    """The events of a trace.json; raises ValueError naming the first malformed event."""
    data = json.loads(Path(path).read_text())
    events = data.get("traceEvents") if isinstance(data, dict) else data  # both forms are valid
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list")
    for i, e in enumerate(events):
        missing = [k for k in REQUIRED_EVENT_KEYS if k not in e]
        if missing:
            raise ValueError(f"{path}: event {i} ({e.get('name')!r}) lacks {', '.join(missing)}")
        if e["ph"] == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            raise ValueError(f"{path}: complete event {i} ({e['name']!r}) needs a duration >= 0")
        if not isinstance(e["ts"], (int, float)):
            raise ValueError(f"{path}: event {i} ({e['name']!r}) has a non-numeric ts")
    return events


class StageTimer:
    """Times the driver's stages: seconds per stage this iteration (`stage_seconds`), their
    (stage, start, end) spans in end order (`stage_spans`: the gaps between stages are the queue
    times of docs/metrics.md), and the events of `trace.json` (complete events for stages,
    instant events for state-machine phases), appended at every `flush`."""

    def __init__(self, trace_path: Path | None = None, workers: dict[str, str] | None = None):
        self.trace_path = trace_path
        self.workers = dict(workers or {})   # role -> who does its stages (named in every event)
        self.iteration, self.version = 0, ""
        self.stage_seconds: dict[str, float] = {}
        self.stage_peaks: dict[str, dict[str, float]] = {}   # stage -> {"rss_gb", "cuda_gb"} (obs/memory.py)
        self.stage_roles: dict[str, str] = {}                # stage -> the role it runs
        self.stage_spans: list[tuple[str, float, float]] = []
        self.lane_spans: list[tuple[str, float, float]] = []   # of stage_spans, those absorbed from a lane
        self.waits: list[tuple[float, float]] = []            # the training lane waiting for a lane
        self._events: list[dict] = []
        self._t0 = time.perf_counter()

    def start_iteration(self, iteration: int) -> None:
        self.iteration, self.stage_seconds, self.stage_spans, self.stage_peaks = iteration, {}, [], {}
        self.lane_spans, self.waits = [], []

    def lane(self) -> StageTimer:
        """A timer for another thread's stages on this timeline (same clock, no trace file of
        its own): what it records reaches trace.json through `absorb`."""
        lane = StageTimer(None, self.workers)
        lane._t0 = self._t0
        return lane

    def absorb(self, other: StageTimer) -> None:
        """Take in the seconds, spans and trace events another lane's timer recorded (the
        generation lane of an asynchronous pipeline), as if timed here; `other` keeps none."""
        for name, seconds in other.stage_seconds.items():
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + seconds
        for name, peaks in other.stage_peaks.items():
            self._peak(name, peaks)
        self.stage_roles.update(other.stage_roles)
        other.stage_peaks = {}
        self.stage_spans = other.stage_spans + self.stage_spans
        self.lane_spans = self.lane_spans + other.stage_spans
        self._events.extend(other._events)
        other.stage_seconds, other.stage_spans, other._events = {}, [], []

    def worker(self, role: str) -> str:
        return self.workers.get(role, f"pid {os.getpid()}")

    def mark(self, phase: str, version: str) -> None:
        """A state-machine phase entered (an instant event)."""
        self.version = version
        self._events.append({"name": phase, "ph": "i", "s": "g", "ts": self._now(), "pid": 0, "tid": 0,
                             "args": {"iteration": self.iteration, "version": version}})

    @contextmanager
    def stage(self, name: str, role: str):
        memory.reset_peak()
        self.stage_roles[name] = role
        start, t = self._now(), time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._peak(name, memory.peak())
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + end - t
            self.stage_spans.append((name, t, end))
            self._events.append({"name": name, "cat": role, "ph": "X", "ts": start, "dur": (end - t) * 1e6,
                                 "pid": 0, "tid": role,
                                 "args": {"iteration": self.iteration, "role": role, "worker": self.worker(role),
                                          "version": self.version}})

    @contextmanager
    def waiting(self):
        """The training lane waits for the generation lane (its critical path goes through it)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.waits.append((t, time.perf_counter()))

    def critical_seconds(self) -> dict[str, float]:
        """This iteration's stage seconds on the training lane's critical path (`critical_seconds`)."""
        lane = set(self.lane_spans)
        own = [s for s in self.stage_spans if s not in lane]
        return critical_seconds(own, self.lane_spans, self.waits)

    def memory_metrics(self) -> dict[str, float]:
        """memory/<stage>_peak_<rss|cuda>_gb for this iteration's stages, and
        memory/role_<role>_peak_<rss|cuda>_gb, the largest over a role's stages."""
        out: dict[str, float] = {}
        for name, peaks in self.stage_peaks.items():
            role = self.stage_roles.get(name, "driver")
            for kind, gb in peaks.items():
                out[f"memory/{name}_peak_{kind}"] = gb
                key = f"memory/role_{role}_peak_{kind}"
                out[key] = max(out.get(key, 0.0), gb)
        return out

    def _peak(self, name: str, peaks: dict[str, float]) -> None:
        held = self.stage_peaks.setdefault(name, {})
        for k, v in peaks.items():
            held[k] = max(held.get(k, 0.0), v)

    def _now(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def flush(self) -> None:
        """Append this process's events to trace.json (kept valid JSON at every flush)."""
        if self.trace_path is None or not self._events:
            return
        old = []
        if self.trace_path.is_file():
            try:
                old = json.loads(self.trace_path.read_text()).get("traceEvents", [])
            except ValueError as e:   # torn by a crash or a full disk: a measurement, not a fact
                aside = self.trace_path.with_name(f"{self.trace_path.name}.unreadable-{time.time_ns()}")
                os.replace(self.trace_path, aside)
                print(f"sealrl: {self.trace_path} cannot be read ({e}); set aside as {aside.name}, a new "
                      "timeline starts", file=sys.stderr, flush=True)
        tmp = self.trace_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"traceEvents": old + self._events}))
        os.replace(tmp, self.trace_path)
        self._events = []
