"""`make test`: the suite in two pytest processes at once, one lane for the tests that start Ray
(marked `ray` by tests/conftest.py; they run one after another on one shared local Ray) and one
for the rest. The Ray runs keep both cores busy; most of the rest waits (deadlines, process
starts, sandboxes), so the lanes overlap well: on 2 cores the suite takes about two thirds of
one serial run (docs/benchmarks.md, "Test suite").

Each lane writes its own log (shown when it ends, the Ray lane's last); the exit status is
the first failing lane's (pytest's: 1 failed tests, 5 no tests collected). Extra arguments go
to both lanes' pytest (e.g. `-x`, `--timeout 900`).

A process that dies of a signal (a Ray worker: "the worker's process died") leaves no Python
traceback in pytest's report. The lanes run with PYTHONFAULTHANDLER=1, which Ray's workers
inherit, so such a process writes its stack to its log; when a lane fails, the lines of this
run's Ray worker logs that tell how a worker died are printed last (`deaths`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LANES = {"ray": ["-m", "ray"], "rest": ["-m", "not ray"]}
RAY_LOGS = Path(tempfile.gettempdir()) / "ray"
DEATH = re.compile(r"Fatal Python error|\*\*\* SIG[A-Z]+ received|Segmentation fault|Bus error|terminate called|"
                   r"out of memory")


def deaths(since: float, tail: int = 60) -> list[str]:
    """From each Ray worker's log written since `since` (epoch seconds) that says how the worker
    died (DEATH: a fault handler's stack, Ray's own signal line, a C++ abort, an allocation
    failure), its lines from the first such one on, at most `tail`, each prefixed by the file's
    name. Ray's own logs are left out: their hints name these causes as possibilities."""
    found = []
    for log in sorted(RAY_LOGS.glob("session_*/logs/worker-*")):
        if log.is_file() and log.stat().st_mtime >= since:
            lines = log.read_text(errors="replace").splitlines()
            first = next((i for i, line in enumerate(lines) if DEATH.search(line)), None)
            if first is not None:
                found += [f"{log.name}: {line}" for line in lines[first:first + tail]]
    return found


def main(extra: list[str]) -> int:
    logs = Path(tempfile.mkdtemp(prefix="sealrl-test-lanes-"))
    start, began = time.monotonic(), time.time()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    procs = {}
    for name, select in LANES.items():
        out = (logs / f"{name}.log").open("w")
        procs[name] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select,
                                        *extra, "tests"], stdout=out, stderr=subprocess.STDOUT, env=env)
    print(f"make test: two lanes ({', '.join(LANES)}), logs in {logs}", flush=True)
    codes: dict[str, int] = {}
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                print(f"\n==== lane {name}: exit {proc.returncode} after {time.monotonic() - start:.0f} s ====",
                      flush=True)
                sys.stdout.write((logs / f"{name}.log").read_text())
                sys.stdout.flush()
        time.sleep(1.0)
    failed = [name for name in LANES if codes[name] != 0]
    if failed and (lines := deaths(began)):
        print(f"\n==== how processes died, from the Ray logs under {RAY_LOGS} ====", *lines, sep="\n", flush=True)
    print(f"\nmake test: {time.monotonic() - start:.0f} s; " +
          ("every lane passed" if not failed else f"failed lanes: {', '.join(failed)}"), flush=True)
    return codes[failed[0]] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
