"""reward.stream: the generation lane's time (generate + reward) with scoring streamed while
other rows still decode, against scoring once the whole iteration is generated.

The workload is the multi-turn calculator task (examples/arith_tools.yaml: up to 2 turns of up
to 24 tokens per episode, 64 in all) with a reward that takes time per sample: the task's own
verifier (tool_answer) plus `--latency-ms` per call, either waiting (`--kind wait`: a remote
judge, a sandbox's wall clock) or computing (`--kind cpu`: a busy loop, competing with the
decode for the cores, as math-verify's sympy would). Both runs use `reward.num_scorers`
scorer processes and the same seeds; they must end on the same weights (checked: the run is
the same, only its timing differs). Per iteration the lane's time is time/generate_s +
time/reward_s (what streaming can shorten: at best by the shorter of the two); the first
iteration is left out (warm-up), then the mean over the others. The two settings alternate
per repeat so that the shared machine's load drifts over both alike.

Run:
    .venv/bin/python benchmarks/reward_stream.py                          # wait, 20 ms, 4 iterations x 2 repeats
    .venv/bin/python benchmarks/reward_stream.py --kind cpu --latency-ms 10

The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as the CLI: idle OpenMP threads sleep

from sealrl.config import load_config  # noqa: E402
from sealrl.trainer.driver import train  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "arith_tools.yaml"
REWARD = '''
import time

from sealrl.rewards.base import RewardSample
from sealrl.rewards.episodes import ToolAnswerMatch

MATCH = ToolAnswerMatch()


def score(response, ground_truth):
    """The tool task's verifier, after {latency_ms} ms of {kind}."""
    end = time.perf_counter() + {latency_ms} / 1000
    if "{kind}" == "wait":
        time.sleep({latency_ms} / 1000)
    while time.perf_counter() < end:
        pass
    return MATCH(RewardSample(sample_id="x", prompt="", response=response, ground_truth=ground_truth))
'''


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8, help="data.prompts_per_iter")
    p.add_argument("--n", type=int, default=8, help="rollout.n")
    p.add_argument("--kind", choices=["wait", "cpu"], default="wait")
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--scorers", type=int, default=2, help="reward.num_scorers")
    p.add_argument("--threads", type=int, default=1, help="run.threads")
    return p.parse_args()


def run_once(args, out: Path, reward: Path, stream: bool, repeat: int) -> dict:
    name = f"stream_{str(stream).lower()}_{repeat}"
    cfg = load_config(str(CONFIG), [f"run.iterations={args.iterations}", f"data.prompts_per_iter={args.prompts}",
                                    f"rollout.n={args.n}", f"reward.fn={reward}:score",
                                    f"reward.num_scorers={args.scorers}", f"reward.stream={str(stream).lower()}",
                                    f"run.threads={args.threads}", "run.loggers=",
                                    "run.max_wall_s=0", "run.checkpoint_every=0", "eval.num=4",
                                    f"run.output_dir={out}", f"run.name={name}"])
    summary = train(cfg)
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()][1:]
    gen = sum(r["time/generate_s"] for r in rows) / len(rows)
    rew = sum(r["time/reward_s"] for r in rows) / len(rows)
    return {"generate_s": gen, "reward_s": rew, "lane_s": gen + rew, "weights_hash": summary["weights_hash"]}


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        reward = out / "slow_reward.py"
        reward.write_text(REWARD.format(latency_ms=args.latency_ms, kind=args.kind))
        runs = {False: [], True: []}
        for repeat in range(args.repeats):
            for stream in (False, True):
                r = run_once(args, out, reward, stream, repeat)
                runs[stream].append(r)
                print(json.dumps({"stream": stream, "repeat": repeat, **r}), flush=True)
    mean = {s: {k: sum(r[k] for r in rs) / len(rs) for k in ("generate_s", "reward_s", "lane_s")}
            for s, rs in runs.items()}
    hashes = {r["weights_hash"] for rs in runs.values() for r in rs}
    print(json.dumps({"kind": args.kind, "latency_ms": args.latency_ms, "samples_per_iter": args.prompts * args.n,
                      "scorers": args.scorers, "unstreamed": mean[False], "streamed": mean[True],
                      "lane_saving": 1 - mean[True]["lane_s"] / mean[False]["lane_s"],
                      "same_weights": len(hashes) == 1, "loadavg_before": load_before,
                      "loadavg_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
