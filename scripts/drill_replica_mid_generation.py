"""Drill (issue 27, docs/cluster.md section 4): a Ray rollout replica running tool episodes is
killed with SIGKILL while it generates, and the run must notice within seconds, replace it, and
end with the weights of the same run left alone.

    .venv/bin/python scripts/drill_replica_mid_generation.py OUT_DIR

runs `examples/arith_tools.yaml` on one Ray replica for 12 iterations twice: `killed`, where
once 3 iterations are written the replica's process (`ray::_RoleHost`, the one with a forked
child: its tool worker) is killed as soon as its CPU time grows across three 20 ms polls on end
(it is generating: a weight load at this size takes a few ms), and `clean`, untouched. Prints
one JSON line: when the kill struck, each run's weights hash, and the killed run's iterations
with a replacement (`rollout/replica_replacements`, `rollout/replica_recovery_s`, and the
generate stage's seconds, which hold the detection and the replacement).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["placement.backend=ray", "placement.rollout_replicas=1", "placement.num_cpus=3", "run.iterations=12",
        "run.max_wall_s=0", "eval.num=0", "run.eval_every=0"]


def start(out: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sealrl.cli", "train", "examples/arith_tools.yaml", *ARGS,
           f"run.output_dir={out}", f"run.name={name}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)


def cpu_ticks(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])   # utime + stime
    except OSError:
        return None


def replicas_with_a_child() -> list[int]:
    """Ray worker processes hosting a role that have forked a child (the tool worker)."""
    parent_of, hosts = {}, []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            parent_of[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (p / "cmdline").read_bytes().startswith(b"ray::_RoleHost"):
                hosts.append(int(p.name))
        except OSError:
            pass
    return [h for h in hosts if h in parent_of.values()]


def kill_while_generating(run: subprocess.Popen, metrics: Path) -> dict | None:
    while run.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    while run.poll() is None:
        for pid in replicas_with_a_child():
            seen = [cpu_ticks(pid)]
            for _ in range(3):
                time.sleep(0.02)
                seen.append(cpu_ticks(pid))
            if None not in seen and all(b > a for a, b in zip(seen, seen[1:])):
                done = len(metrics.read_text().splitlines())
                os.kill(pid, signal.SIGKILL)
                return {"pid": pid, "iterations_written_before": done}
        time.sleep(0.01)
    return None


def main() -> None:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run = start(out, "killed")
    killed = kill_while_generating(run, out / "killed" / "metrics.jsonl")
    rc_killed = run.wait()
    rc_clean = start(out, "clean").wait()
    rows = [json.loads(x) for x in (out / "killed" / "metrics.jsonl").read_text().splitlines()]
    hashes = {n: json.loads((out / n / "summary.json").read_text())["weights_hash"][:8] for n in ("killed", "clean")}
    print(json.dumps({"killed": killed, "exit": [rc_killed, rc_clean], "weights_hash": hashes,
                      "same_weights": hashes["killed"] == hashes["clean"],
                      "replaced_in": [{"iteration": r["iteration"], "replacements": r["rollout/replica_replacements"],
                                       "recovery_s": round(r["rollout/replica_recovery_s"], 2),
                                       "generate_s": round(r["time/generate_s"], 2)}
                                      for r in rows if r.get("rollout/replica_replacements")]}))


if __name__ == "__main__":
    main()
