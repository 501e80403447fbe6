"""Check by hand the inputs of the decoupled objective on a finished asynchronous run.

For each iteration i >= 1 of RUN_DIR (trained with rollout.max_staleness >= 1,
algorithm.correction=token_is and run.checkpoint_every=1, so that every committed version's
weights are on disk), teacher-force the sealed samples with a plain Hugging Face forward
(float64 log-softmax, temperature 1.0: the tool example's) under

- the weights of the version that sampled them (the stamp of `rollout_log_probs`) and compare
  with the sealed behaviour log-probs;
- the weights of the version that consumed them (the stamp of `old_log_probs`) and compare with
  the sealed proximal log-probs;

then recompute the truncated IS weights min(exp(proximal - behaviour), cap) over the policy
tokens and compare their mean, max and min with the logged `correction/is_weight_*`.

    python scripts/check_decoupled_run.py RUN_DIR [--model sealrl/assets/arith-tools] [--cap 2.0]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def model_at(run: Path, base: str, step: int):
    model = AutoModelForCausalLM.from_pretrained(base)
    if step:
        model.load_state_dict(load_file(str(run / "checkpoints" / f"step_{step}" / "actor_model.safetensors")))
    return model.eval()


def teacher_forced(model, sample: dict) -> list[float]:
    ids = list(sample["prompt_ids"]) + list(sample["response_ids"])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    p = len(sample["prompt_ids"])
    return [float(lp[p + t - 1, tok]) for t, tok in enumerate(sample["response_ids"])]


def step_of(version: str) -> int:
    return int(version.split("@")[1].split(".")[0])   # run@step.attempt#hash


def check_iteration(run: Path, base: str, i: int, metrics: dict, cap: float) -> str:
    table = pq.read_table(run / "experience" / f"iter_{i:06d}.parquet")
    fields = json.loads(table.schema.metadata[b"sealrl"])["fields"]
    sampled, consumed = step_of(fields["rollout_log_probs"]["version"]), step_of(fields["old_log_probs"]["version"])
    sampler, consumer = model_at(run, base, sampled), model_at(run, base, consumed)
    d_behav = d_prox = 0.0
    weights = []
    for s in table.to_pylist():
        behav, prox = teacher_forced(sampler, s), teacher_forced(consumer, s)
        for t, ok in enumerate(s["response_mask"]):
            if ok:
                d_behav = max(d_behav, abs(behav[t] - s["rollout_log_probs"][t]))
                d_prox = max(d_prox, abs(prox[t] - s["old_log_probs"][t]))
                weights.append(min(math.exp(prox[t] - behav[t]), cap))
    return (f"iteration {i}: sampled by step {sampled}, consumed by step {consumed}; "
            f"max |behaviour - sealed| {d_behav:.1e}, max |proximal - sealed| {d_prox:.1e}; IS weight "
            f"mean {sum(weights) / len(weights):.5f} (logged {metrics['correction/is_weight_mean']:.5f}), "
            f"max {max(weights):.4f} ({metrics['correction/is_weight_max']:.4f}), "
            f"min {min(weights):.4f} ({metrics['correction/is_weight_min']:.4f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--model", default="sealrl/assets/arith-tools", help="the run's model.path (step 0)")
    p.add_argument("--cap", type=float, default=2.0, help="algorithm.correction_threshold")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = [json.loads(x) for x in (args.run / "metrics.jsonl").read_text().splitlines()]
    for i in range(1, len(rows)):
        print(check_iteration(args.run, args.model, i, rows[i], args.cap), flush=True)


if __name__ == "__main__":
    main()
