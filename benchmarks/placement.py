"""Local vs Ray placement on the same small GRPO job (the embedded demo's size).

Both runs train from the shipped warm start with the demo config (32 prompts x 8, up to 5 new
tokens) for the same number of iterations, in one process, one after the other. The Ray run
puts the rollout role on standalone replicas (Ray actors): every iteration ships the weights
through the manifest-verified sync, dispatches requests and joins samples by id. Reported: the
median `time/iteration_s` after warm-up of each run, and `overhead` = ray / local - 1.

    .venv/bin/python benchmarks/placement.py [--iterations 40] [--replicas 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sealrl.config import load_config  # noqa: E402
from sealrl.trainer.driver import train  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arith_grpo.yaml"


def median_iteration_s(run_dir: Path, warmup: int) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["time/iteration_s"] for r in rows[warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    args = ap.parse_args()
    common = [f"run.iterations={args.iterations}", "run.eval_every=0", "run.checkpoint_every=0",
              "eval.num=50", "run.max_wall_s=0"]
    out = Path(tempfile.mkdtemp(prefix="sealrl-placement-"))
    result = {"iterations": args.iterations, "warmup": args.warmup, "replicas": args.replicas}
    for name, extra in (("local", []),
                        ("ray", ["placement.backend=ray", f"placement.rollout_replicas={args.replicas}",
                                 f"placement.cpus_per_replica={args.cpus_per_replica}", "placement.num_cpus=2"])):
        cfg = load_config(str(EXAMPLE), common + extra + [f"run.output_dir={out}", f"run.name={name}"])
        summary = train(cfg)
        result[f"{name}_iteration_s"] = round(median_iteration_s(out / name, args.warmup), 4)
        result[f"{name}_weights_hash"] = summary["weights_hash"]
        print(f"{name}: median iteration {result[f'{name}_iteration_s']:.3f} s", file=sys.stderr)
    result["same_weights"] = result["local_weights_hash"] == result["ray_weights_hash"]
    result["overhead"] = round(result["ray_iteration_s"] / result["local_iteration_s"] - 1, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
