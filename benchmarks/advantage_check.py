"""Does every sealed batch of a GRPO run carry what TRL's GRPOTrainer would compute from the same
responses? Rewards, loss masks and advantages, over the whole run.

For each sample of each iteration file of RUN/experience: the response decoded as TRL decodes
completions (`skip_special_tokens=True`) and scored by benchmarks/learn_real_reward.py against
the row's ground truth, next to the reward the run recorded; the loss mask's length next to the
response's (TRL's completion mask covers every token up to and including the first eos); the
advantages next to TRL's group formula, (r - mean) / (std + 1e-4), std unbiased. Complements
benchmarks/step_gradient.py --replay, which replays the run's updates from its own advantages.

    .venv/bin/python benchmarks/advantage_check.py RUN [--model models/smollm2-135m-instruct]

The last line printed is JSON: samples, reward and mask mismatches, the largest advantage
difference.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_real_reward import compute_score  # noqa: E402

from sealrl.experience.store import read_iteration  # noqa: E402


def trl_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's GRPO advantages of groups along the last dimension: (r - mean) / (std + 1e-4), std
    unbiased (TRL's `nanstd`)."""
    return (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)


def check(run: Path, model: Path) -> dict:
    tok = AutoTokenizer.from_pretrained(model)
    out = {"iterations": 0, "samples": 0, "reward_mismatch": 0, "mask_mismatch": 0, "max_abs_advantage_diff": 0.0}
    for path in sorted((run / "experience").glob("iter_*.parquet")):
        batch = read_iteration(path)
        adv, mask, records = batch.get("advantages"), batch.get("response_mask"), batch.get("reward_records")
        groups: dict[str, list[tuple[int, float]]] = {}
        for i, s in enumerate(batch.samples):
            r = compute_score(s.data_source, tok.decode(list(s.response_ids), skip_special_tokens=True),
                              json.loads(s.ground_truth))   # sealed as JSON text (trainer/prepare.py)
            out["reward_mismatch"] += abs(r - records[i].total) > 1e-9
            out["mask_mismatch"] += int(mask[i].sum()) != len(s.response_ids)
            groups.setdefault(s.group_id, []).append((i, r))
        for members in groups.values():
            trl = trl_advantages(torch.tensor([r for _, r in members], dtype=torch.float32))
            for (i, _), a in zip(members, trl):
                diff = float((adv[i, :len(batch.samples[i].response_ids)] - a).abs().max())
                out["max_abs_advantage_diff"] = max(out["max_abs_advantage_diff"], diff)
        out["iterations"] += 1
        out["samples"] += len(batch.samples)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished run folder")
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"), help="its tokenizer")
    args = p.parse_args()
    print(json.dumps(check(args.run, args.model)))


if __name__ == "__main__":
    main()
