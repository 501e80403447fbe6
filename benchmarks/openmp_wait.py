"""How long idle OpenMP threads wait before they sleep, and what it costs: the vs_trl tiny
workload (the embedded model, 16 prompts x 8, 16 new tokens, GRPO with KL, 2 torch threads)
trained through `train()` for 15 iterations in a fresh process per setting, the median
`time/iteration_s` (and its stages) of the last 12 printed per setting.

Settings (each an environment for the child process, set before torch loads):
  passive   OMP_WAIT_POLICY=PASSIVE (threads sleep at once; the CLI's choice until session 17)
  cli       what `sealrl train` sets (sealrl/cli.py: GOMP_SPINCOUNT=3000, about 30 us)
  default   nothing set: GNU OpenMP's own spin (GOMP_SPINCOUNT 300,000, about 3 ms)
With --busy, another process keeps one core busy for the whole measurement (a machine shared
with other work), which is where spinning costs.

    .venv/bin/python benchmarks/openmp_wait.py [--busy] [--settings passive cli default]

The last line printed is JSON: {setting: {iteration_s, stages}}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "cli": "cli", "default": {}}
JOB = ["data.task=arith", "data.num_train=2000", "eval.num=16", "data.prompts_per_iter=16", "rollout.n=8",
       "rollout.temperature=1.0", "rollout.max_new_tokens=16", "algorithm.name=grpo", "algorithm.kl_coef=0.04",
       "algorithm.kl_in=loss", "algorithm.kl_estimator=k3", "actor.lr=1e-4", "actor.lr_schedule=constant",
       "run.iterations=15", "run.loggers=", "run.threads=2", "run.seed=0", "run.checkpoint_every=0"]
CHILD = ("import sys\n"
         "if sys.argv[1] == 'cli':\n    import sealrl.cli\n"
         "from sealrl.config import build_config\nfrom sealrl.trainer.driver import train\n"
         "train(build_config(None, sys.argv[2:]))\n")


def one(setting: str, workdir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if ENVS[setting] != "cli":
        env.update(ENVS[setting])
    args = [*JOB, f"run.output_dir={workdir}", f"run.name={setting}"]
    subprocess.run([sys.executable, "-c", CHILD, setting, *args], check=True, cwd=ROOT, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (workdir / setting / "metrics.jsonl").read_text().splitlines()][3:]
    med = lambda key: round(statistics.median(r[key] for r in rows), 4)  # noqa: E731
    stages = {k: med(k) for k in rows[0] if k.startswith("time/") and k.endswith("_s")
              and k not in ("time/iteration_s", "time/train_wall_s")}
    return {"iteration_s": med("time/iteration_s"), "stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", action="store_true", help="keep one core busy with another process meanwhile")
    ap.add_argument("--settings", nargs="+", choices=tuple(ENVS), default=list(ENVS))
    args = ap.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        with tempfile.TemporaryDirectory(prefix="openmp_wait_") as tmp:
            out = {s: one(s, Path(tmp)) for s in args.settings}
    finally:
        if busy is not None:
            busy.kill()
    print(json.dumps({"busy_core": args.busy, **out}))


if __name__ == "__main__":
    main()
