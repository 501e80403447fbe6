"""The driver's memory and the weight transfer per iteration, at the mid shape (issue 27, item 5).

Two GRPO runs of the same job, one after the other in fresh processes: everything in one
process (`local`), and `ray` with 2 data-parallel actor ranks (FSDP2) and 2 rollout replicas.
For each: the driver's peak resident set over the iterations (the largest
`memory/role_*_peak_rss_gb` of any iteration: Linux VmHWM, this process only; ranks and replicas
are other processes) and over the whole run (`_with_end`: VmHWM when train() returns, the
checkpoint and the final model folder included, which stream the ranks' weights and Adam state
through the driver a 64 MiB bucket at a time),
the weight bytes one sync moves (`sync/bytes`), how many of them the driver held
(`sync/driver_bytes`) and its time (`time/weight_sync_s`), and the size of
the actor's fp32 weights and of weights plus Adam's two moments, which is what the driver would
hold if it mirrored the ranks.

    .venv/bin/python benchmarks/driver_memory.py [--iterations 4]      (prints one JSON line)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
JOB = ["data.task=arith", "data.num_train=256", "eval.num=8", "data.prompts_per_iter=8", "rollout.n=4",
       "rollout.max_new_tokens=16", "run.checkpoint_every=0", "run.loggers=", "run.eval_every=0",
       "algorithm.name=grpo", "algorithm.kl_coef=0.0"]
RAY = ["placement.backend=ray", "placement.actor_ranks=2", "placement.dp_strategy=fsdp2",
       "placement.rollout_replicas=2", "placement.num_cpus=4", "placement.timeout_s=600"]


def one_run(model: Path, workdir: Path, name: str, iterations: int, extra: list[str]) -> dict:
    """A run in its own interpreter (a fresh peak RSS), read back from its metrics."""
    code = ("import sys; from sealrl.config import build_config; from sealrl.trainer.driver import train; "
            "train(build_config(None, sys.argv[2:])); "   # then the whole run's peak, end checkpoint included
            "open(sys.argv[1], 'w').write(next(x for x in open('/proc/self/status') if x.startswith('VmHWM')))")
    args = [f"model.path={model}", f"run.output_dir={workdir}", f"run.name={name}", f"run.iterations={iterations}",
            *JOB, *extra]
    peak = workdir / f"{name}.vmhwm"
    subprocess.run([sys.executable, "-c", code, str(peak), *args], check=True, cwd=ROOT)
    rows = [json.loads(x) for x in (workdir / name / "metrics.jsonl").read_text().splitlines()]
    rss = [v for r in rows for k, v in r.items() if k.startswith("memory/role_") and k.endswith("_peak_rss_gb")]
    return {"driver_peak_rss_gb": round(max(rss), 3),
            "driver_peak_rss_gb_with_end": round(int(peak.read_text().split()[1]) / 2 ** 20, 3),
            "sync_bytes_per_iteration": rows[-1]["sync/bytes"],
            "driver_sync_bytes_per_iteration": rows[-1].get("sync/driver_bytes"),   # None before the metric existed
            "weight_sync_s_median": round(statistics.median(r["time/weight_sync_s"] for r in rows), 3),
            "iteration_s_median": round(statistics.median(r["time/iteration_s"] for r in rows[1:]), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    args = ap.parse_args()
    from sealrl.models.synthetic import build_mid, save_mid
    params = sum(p.numel() for p in build_mid()[0].parameters())
    with tempfile.TemporaryDirectory(prefix="driver_memory_") as tmp:
        model = save_mid(Path(tmp) / "mid")
        out = {"shape": "mid", "actor_params": params, "actor_weights_gb": round(params * 4 / 2 ** 30, 3),
               "actor_weights_and_adam_gb": round(params * 12 / 2 ** 30, 3)}
        for name, extra in (("local", []), ("ray", RAY)):
            out[name] = one_run(model, Path(tmp), name, args.iterations, extra)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
