"""Does TRL's GRPOTrainer itself take, step after step, the update step_gradient.py writes out
(the one sealrl's runs replay to, `step_gradient.py RUN --replay`)?

Runs the TRL side of benchmarks/learn_real.py (its workload, config and prompt order at --seed)
for --steps steps, keeping every batch the trainer built (its prompt and completion ids and
masks, and its advantages: the output of `_generate_and_score_completions`) and its final
weights. Then, from the initial model, it replays those batches with step_gradient's loss
(TRL's dapo loss at ratio 1, one unpadded sample at a time) and torch's AdamW after
clip_grad_norm_, and compares the two final weights as `--replay` does. With
step_gradient's `--replay` on a sealrl run this closes the loop: both trainers take that
update from whatever they sampled.

    .venv/bin/python benchmarks/trl_replay.py --steps 10

Each batch is also judged as benchmarks/sampler_check.py judges samples, under the weights the
trainer holds when it built the batch (the weights that sampled it, if TRL samples on policy): per
response the sum of surprisal minus entropy, which has mean 0 when the tokens were drawn from
softmax(logits / T) of those weights (`on_policy`: its mean, standard error and z over every
response), and the judge's token-mean entropy per step beside the entropy TRL logged. And each
batch's advantages are checked against its text: every completion decoded as the reward sees it
(`skip_special_tokens=True`), scored by learn_real_reward.compute_score against its row's ground
truth, and TRL's group formula recomputed from those scores (`advantages_from_text`: the largest
difference from the advantages the trainer used).

The last line printed is JSON (the same keys as `step_gradient.py --replay`, plus TRL's
per-step entropy and reward, `on_policy` and `advantages_from_text`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import advantage_check  # noqa: E402
import learn_real  # noqa: E402
import sampler_check  # noqa: E402
import step_gradient  # noqa: E402

from sealrl.config import build_config  # noqa: E402

KEPT = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="TRL optimizer steps (learn_real's --iterations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--data", type=Path, default=Path("examples/learn_real/data"))
    p.add_argument("--model-path", type=Path, default=Path("models/smollm2-135m-instruct"))
    return p.parse_args(argv)


def batch_rows(kept: dict[str, torch.Tensor]) -> tuple[list[tuple], int]:
    """One TRL batch as step_gradient rows: each prompt without its left padding, each completion
    up to its mask's end (the eos included), the sample's advantage on every completion token."""
    rows = []
    for pid, pm, cid, cm, adv in zip(*(kept[k] for k in KEPT)):
        n = int(cm.sum())
        if not bool(cm[:n].all()):
            raise SystemExit("trl_replay: a completion mask with a hole; this replay assumes a prefix")
        rows.append((pid[pm.bool()].tolist(), cid[:n].tolist(), adv.expand(n), torch.ones(n)))
    return rows, int(kept["completion_mask"].sum())


def advantage_gap(tokenizer, inputs: list[dict], out: dict, n: int) -> float:
    """The largest |advantage TRL trains on - TRL's group formula on the batch's own text|: each
    completion up to its mask decoded as TRL decodes it for the reward, scored against its row's
    ground truth, (r - group mean) / (group std + 1e-4) over each run of n samples."""
    rewards = []
    for row, ids, mask in zip(inputs, out["completion_ids"], out["completion_mask"]):
        text = tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        rewards.append(learn_real.compute_score(learn_real.learn_real_data.DATA_SOURCE, text, row["ground_truth"]))
    ours = advantage_check.trl_advantages(torch.tensor(rewards, dtype=torch.float32).view(-1, n)).flatten()
    return float((ours - out["advantages"].flatten()).abs().max())


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="trl_replay_"))
    side = learn_real.parse_args(["--iterations", str(args.steps), "--seed", str(args.seed),
                                  "--model-path", str(args.model_path.resolve())])
    side.data, side.workdir = args.data.resolve(), workdir
    trainer, _ = learn_real.trl_trainer(side, [])
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    steps: list[tuple[list[tuple], int]] = []   # each batch the trainer trained on, as replay rows
    generate = trainer._generate_and_score_completions

    judged: list[float] = []   # per response: the sum over its tokens of surprisal - entropy
    step_entropy: list[float] = []
    advantage_diff: list[float] = []   # per batch: max |TRL's advantage - the one its text gives|
    gen = torch.Generator().manual_seed(args.seed)

    def keep(inputs, *a, **k):   # every batch the trainer trains on, as it built it, judged by its sampling weights
        out = generate(inputs, *a, **k)
        advantage_diff.append(advantage_gap(trainer.processing_class, inputs, out, side.n))
        steps.append(batch_rows({name: out[name].detach().clone() for name in KEPT}))
        scored = [(sampler_check.judge(trainer.model, p, [r], side.temperature, gen)[0], len(r))
                  for p, r, _, _ in steps[-1][0]]
        judged.extend(float((-s["log_probs"] - s["entropy"]).sum()) for s, _ in scored)
        step_entropy.append(sum(float(s["entropy"].sum()) for s, _ in scored) / sum(n for _, n in scored))
        return out

    trainer._generate_and_score_completions = keep
    trainer.train()
    if len(steps) != args.steps:
        raise SystemExit(f"trl_replay: TRL built {len(steps)} batches for {args.steps} steps "
                         "(one generation per step expected)")
    trained = {n: p.detach() for n, p in trainer.model.named_parameters()}
    cfg = build_config(None, [f"model.path={args.model_path.resolve()}", f"actor.lr={side.lr}",
                              f"rollout.temperature={side.temperature}"])
    replayed = step_gradient.trl_replay(cfg, steps)
    shutil.rmtree(workdir, ignore_errors=True)   # TRL's output_dir (save_strategy="no": nothing kept)
    logs = [h for h in trainer.state.log_history if "reward" in h]
    report = {"seed": args.seed, "steps": args.steps, **step_gradient.compare_changes(start, trained, replayed),
              "on_policy": {"responses": len(judged), **sampler_check.mean_z(np.array(judged))},
              "advantages_from_text": {"max_abs_diff": max(advantage_diff), "per_step": advantage_diff},
              "judged_entropy": [round(x, 4) for x in step_entropy],
              "entropy": [round(h["entropy"], 4) for h in logs], "reward_mean": [round(h["reward"], 4) for h in logs]}
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
