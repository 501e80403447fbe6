"""Does sealrl's faster-sharpening policy on learn_real follow its sampler's random numbers?

On learn_real (benchmarks/learn_real.py) sealrl's training reward runs ahead of TRL's from
step 11 on, over nine paired seeds, although each piece was checked equal: both samplers draw
from the policy at the training temperature, both trainers take the same written-out update
from a batch, the rewards, masks and advantages are TRL's (docs/benchmarks.md, sessions 21-26).
The one difference those checks judge only a response at a time is where the randomness comes
from: sealrl's engine draws each token by inverse CDF from a counter-hashed uniform per
(candidate seed, step) (sealrl/rollout/sampling.py); TRL's `generate` draws from torch's
generator. This script runs learn_real's sealrl side unchanged except for those uniforms: each
generate call takes them from one torch.Generator seeded with the run seed (torch.rand, float64),
so the draws are still exact draws from the same distribution, from another source. Then it
sets each seed's training reward per step beside the native run's and TRL's of the same seed
(from docs/learn_real/paired.json, or --paired).

If the gap to TRL stays with the torch-generator runs, the hashed uniforms are not its cause.

Run (about 12 minutes per seed on 2 cores; the held-out evaluation runs before and after only):
    .venv/bin/python benchmarks/sampler_swap.py --seeds 0,1,2 --workdir /tmp/swap
The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCKS = ((0, 10), (10, 20), (20, 30))
LOG_PREFIX = "sampler_swap: seed "   # + "K: {json}", one line per finished seed on stderr


def torch_uniforms(seed: int):
    """A stand-in for sampling.uniform_noise: (B, S) float64 uniforms from one torch generator."""
    import torch
    gen = torch.Generator().manual_seed(seed)

    def noise(seeds, steps):
        return torch.rand(len(seeds), len(steps), dtype=torch.float64, generator=gen, device="cpu").to(seeds.device)
    return noise


def child(argv: list[str]) -> None:
    """learn_real's sealrl side with the torch-generator uniforms patched into both decode loops."""
    sys.path.insert(0, str(HERE))
    import learn_real

    from sealrl.rollout import loop, scheduler
    args = learn_real.parse_args(argv)
    loop.uniform_noise = scheduler.uniform_noise = torch_uniforms(args.seed)
    learn_real.run_side(args)


def block_means(values: list[float]) -> list[float]:
    """The mean of each 10-step block the values reach."""
    return [statistics.mean(values[a:b]) for a, b in BLOCKS if len(values) >= b]


def paired(diffs: list[float]) -> dict:
    mean = statistics.mean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {"mean": round(mean, 4), "se": None if se is None else round(se, 4),
            "t": round(mean / se, 2) if se else None,
            "above": sum(d > 0 for d in diffs), "seeds": len(diffs)}


def compare(runs: dict[int, dict], paired_json: Path) -> dict:
    """Per 10-step block: torch-generator sealrl, native sealrl and TRL, and their paired differences."""
    ref = json.loads(paired_json.read_text())
    native = {s["seed"]: s for s in ref["sealrl"]["seeds"]}
    trl = {s["seed"]: s for s in ref["trl"]["seeds"]}
    seeds = [s for s in sorted(runs) if s in native and s in trl]
    out = {"seeds": seeds, "blocks": [f"steps {a + 1}-{b}" for a, b in BLOCKS]}
    for key in ("reward_mean", "entropy"):
        rows = {s: {"torch": block_means(runs[s].get(key, [])), "native": block_means(native[s].get(key, [])),
                    "trl": block_means(trl[s].get(key, []))} for s in seeds}
        rows = {s: r for s, r in rows.items() if all(len(v) == len(BLOCKS) for v in r.values())}
        section = {"per_seed": {s: {k: [round(x, 4) for x in v] for k, v in r.items()} for s, r in rows.items()}}
        if rows:
            for a, b in (("torch", "trl"), ("native", "trl"), ("torch", "native")):
                section[f"{a}_minus_{b}"] = [paired([r[a][i] - r[b][i] for r in rows.values()])
                                             for i in range(len(BLOCKS))]
        out[key] = section
    out["after"] = {s: {"torch": runs[s]["after"], "native": native[s]["after"], "trl": trl[s]["after"]}
                    for s in seeds}
    return out


def main() -> None:
    if "--side" in sys.argv:   # the child: learn_real's own arguments
        return child(sys.argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workdir", type=Path, required=True, help="run folders (kept)")
    p.add_argument("--data", type=Path, default=Path("examples/learn_real/data"))
    p.add_argument("--paired", type=Path, default=Path("docs/learn_real/paired.json"),
                   help="learn_real's merged report with the native and TRL runs of these seeds")
    p.add_argument("--eval-every", type=int, default=30, help="held-out evaluation every K steps (30: end only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--from-log", type=Path, default=None, metavar="ERR",
                   help="only compare the seeds a run (stopped or not) wrote to its stderr")
    args = p.parse_args()
    if args.from_log:
        runs = {int(m[0]): json.loads(m[1]) for line in args.from_log.read_text().splitlines()
                if line.startswith(LOG_PREFIX) for m in [line[len(LOG_PREFIX):].split(": ", 1)]}
        print(json.dumps(compare(runs, args.paired)))
        return
    sys.path.insert(0, str(HERE))
    import learn_real
    model = learn_real.parse_args([]).model_path   # the children run learn_real's default model
    if not (model / "config.json").is_file():
        sys.exit(f"sampler_swap: no converted SmolLM2-135M-Instruct folder at {model} "
                 "(`make smollm2`; run from the repository root)")
    runs = {}
    for seed in [int(s) for s in args.seeds.split(",") if s.strip()]:
        cmd = [sys.executable, __file__, "--side", "sealrl", "--seed", str(seed), "--data", str(args.data),
               "--workdir", str(args.workdir / f"seed{seed}"), "--eval-every", str(args.eval_every),
               "--threads", str(args.threads)]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if done.returncode:
            sys.exit(f"sampler_swap: seed {seed} failed with exit status {done.returncode}; its error is above")
        runs[seed] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{LOG_PREFIX}{seed}: {json.dumps(runs[seed])}", file=sys.stderr, flush=True)
    print(json.dumps(compare(runs, args.paired)))


if __name__ == "__main__":
    main()
