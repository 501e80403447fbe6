"""Supervised warm start of the embedded tiny Llama on the embedded arithmetic task.

Why a fixed, small supervised set trained to a plateau: a warm start cut from the steep part
of a supervised curve flatters RL (more supervised steps would have given the same gain). Here
the model sees only `--sft-num` training problems, trained until held-out greedy accuracy stops
moving; what limits it is the data, not the step count, so RL (which gets rewards on the whole
train split) has honest room above it.

Loss: next-token cross-entropy on response tokens only (the answer and <eos>; prompt tokens
are masked with -100). Evaluation: greedy decoding on EMBEDDED_TASK.eval_rows(); a problem is
right when the decoded response, cut at the first <eos>, equals the ground truth exactly.

Run (about 3 minutes on 2 shared CPU cores; stops by itself at the plateau):
    .venv/bin/python scripts/warm_start.py --out sealrl/assets/arith-tiny
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

# Idle OpenMP workers must sleep, not spin: on 2 shared cores a spinning worker made a step of
# this model 40x slower (2.5 s instead of 65 ms) whenever another process held a core.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the OpenMP setting, which is read when torch loads)

from sealrl.data.dataset import Prompt, prompts_from_rows
from sealrl.data.sampler import PromptSampler
from sealrl.data.tasks import EMBEDDED_TASK
from sealrl.models.tiny import build_tiny_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="save model+tokenizer here")
    p.add_argument("--seed", type=int, default=0, help="model init and batch order")
    p.add_argument("--sft-num", type=int, default=EMBEDDED_TASK.sft_num, help="supervised problems")
    p.add_argument("--sft-seed", type=int, default=EMBEDDED_TASK.sft_seed)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-steps", type=int, default=4000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--patience", type=int, default=8,
                   help="plateau: this many evals without a new best held-out accuracy ...")
    p.add_argument("--min-delta", type=float, default=0.01, help="... (a new best beats it by this)")
    p.add_argument("--band", type=float, nargs=2, default=(0.2, 0.5),
                   help="refuse to save a plateau outside this held-out accuracy band")
    p.add_argument("--threads", type=int, default=1,
                   help="1 is as fast as 2 for this model and immune to a busy second core")
    return p.parse_args()


def setup_determinism(seed: int, threads: int) -> None:
    """Same seed, same thread count -> same weights (CPU kernels are deterministic at a fixed
    thread count; the flag makes torch raise if a nondeterministic kernel is ever used)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    random.seed(seed)
    torch.manual_seed(seed)


def collate(prompts: list[Prompt], answer_ids: list[list[int]], pad_id: int) -> dict:
    """Right-padded (B, T) input ids, attention mask and labels (-100 outside the response)."""
    seqs = [list(p.token_ids) + a for p, a in zip(prompts, answer_ids)]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        labels[i, len(p.token_ids):len(s)] = torch.tensor(s[len(p.token_ids):])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@torch.no_grad()
def greedy_accuracy(model, tokenizer, prompts: list[Prompt], max_new_tokens: int,
                    batch_size: int = 500) -> float:
    """Fraction of prompts whose greedy response, cut at the first <eos> and decoded, is the
    ground truth. A response that never stops within max_new_tokens keeps its extra tokens
    and so is wrong."""
    model.eval()
    correct = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        T = max(len(p.token_ids) for p in chunk)
        # Left padding so every prompt ends at the same position.
        ids = torch.full((len(chunk), T), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, T - len(p.token_ids):] = torch.tensor(p.token_ids)
            mask[i, T - len(p.token_ids):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        for p, gen in zip(chunk, out[:, T:].tolist()):
            eos = tokenizer.eos_token_id
            correct += tokenizer.decode(gen[:gen.index(eos)] if eos in gen else gen) == p.ground_truth
    model.train()
    return correct / len(prompts)


def main() -> None:
    args = parse_args()
    setup_determinism(args.seed, args.threads)
    t0 = time.time()
    model, tokenizer = build_tiny_model(seed=args.seed)
    task = EMBEDDED_TASK
    max_len = 32
    sft = prompts_from_rows(task.train_rows(args.sft_num, args.sft_seed), tokenizer, max_len).prompts
    test = prompts_from_rows(task.eval_rows(), tokenizer, max_len).prompts
    answers = [tokenizer(p.ground_truth, add_special_tokens=False).input_ids
               + [tokenizer.eos_token_id] for p in sft]
    sampler = PromptSampler(len(sft), args.batch_size, seed=args.seed, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    model.train()

    curve: list[dict] = []
    best, since_best = -1.0, 0
    batches = iter(sampler)
    for step in range(args.max_steps + 1):
        if step % args.eval_every == 0:
            acc = greedy_accuracy(model, tokenizer, test, task.max_new_tokens)
            train_acc = greedy_accuracy(model, tokenizer, sft, task.max_new_tokens)
            curve.append({"step": step, "heldout_acc": acc, "sft_acc": train_acc,
                          "elapsed_s": round(time.time() - t0, 1)})
            print(json.dumps(curve[-1]), flush=True)
            if acc >= best + args.min_delta - 1e-9:  # accuracies are k/500; no float misses
                best, since_best = acc, 0
            else:
                since_best += 1
            # A plateau also needs the supervised set fitted: a stall is not convergence.
            if (since_best >= args.patience and train_acc >= 0.99) or step == args.max_steps:
                break
        idx = next(batches)
        batch = collate([sft[i] for i in idx], [answers[i] for i in idx], tokenizer.pad_token_id)
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    wall = time.time() - t0
    final = curve[-1]["heldout_acc"]
    plateau = since_best >= args.patience
    print(json.dumps({"final_heldout_acc": final, "steps": curve[-1]["step"],
                      "plateau": plateau, "wall_s": round(wall, 1)}), flush=True)
    if not plateau or not args.band[0] <= final <= args.band[1]:
        raise SystemExit(f"not saved: plateau={plateau}, held-out accuracy {final:.3f} "
                         f"(band {args.band[0]}-{args.band[1]})")
    if args.out is not None:
        save(args, model, tokenizer, curve, wall)


def save(args: argparse.Namespace, model, tokenizer, curve: list[dict], wall: float) -> None:
    """Weights (safetensors), tokenizer, the curve as JSON, and WARM_START.md from this run."""
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    (args.out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    task = EMBEDDED_TASK
    rows = "\n".join(f"| {c['step']} | {c['heldout_acc']:.3f} | {c['sft_acc']:.3f} | {c['elapsed_s']} |"
                     for c in curve)
    command = " ".join([".venv/bin/python", "scripts/warm_start.py", *sys.argv[1:]])
    (args.out / "WARM_START.md").write_text(f"""# arith-tiny: supervised warm start (written by scripts/warm_start.py)

Command: `{command}`

- model: `build_tiny_model(seed={args.seed})` ({sum(p.numel() for p in model.parameters()):,} parameters),
  char tokenizer; torch {torch.__version__}, {args.threads} thread(s), deterministic algorithms on
- task: `EMBEDDED_TASK` in sealrl/data/tasks.py: {task.name} {task.opts}
- supervised data: `EMBEDDED_TASK.train_rows({args.sft_num}, seed={args.sft_seed})` ({args.sft_num} problems),
  loss on response tokens only (answer + `<eos>`), AdamW lr {args.lr}, weight decay {args.weight_decay},
  batch {args.batch_size} (sampler seed {args.seed}, drop_last)
- held-out: greedy decoding, max_new_tokens={task.max_new_tokens}, on `EMBEDDED_TASK.eval_rows()`
  ({task.eval_num} test-split problems, seed {task.eval_seed}); right = decoded response cut at the
  first `<eos>` equals the ground truth
- stop: plateau = {args.patience} evaluations (every {args.eval_every} steps) without a held-out gain of
  {args.min_delta} and the supervised set fitted (>= 99% greedy)

**Final held-out accuracy: {curve[-1]['heldout_acc']:.3f} after {curve[-1]['step']} steps; wall time {wall:.0f} s**
(2 shared CPU cores, other jobs running).

## Why {args.sft_num} problems

A fixed small supervised set trained to a plateau, so the warm start is limited by data, not by
steps (a checkpoint from the steep part of the curve would flatter RL). The figures in this section
were measured with the earlier 81-character vocabulary (before printable ASCII was appended; a
larger embedding draws a different random init from the same seed, so they are indicative here,
not exact). Plateaus of held-out accuracy against the supervised set size (seed 0, 2,500 steps):
300 -> 0.086, 450 -> 0.29,
600 -> 0.80, 750 -> 0.996, 1000 -> 1.00. The transition is steep: the size is a sharp knob.
The plateau is flat, not a pause before a late jump: the same run continued to 5,000 steps ended
at 0.294 (0.284 at step 1,100). The model seed moves it: seed 1 with 450 problems plateaus near
0.21. Two runs of the same command gave identical curves.

Room for RL, measured once with a scratch loop that is not in the repository (plain on-policy
GRPO from this checkpoint: 32 prompts x 8 samples from `train_rows(8000, 0)`, temperature 1,
0/1 exact-match reward, group-normalised advantage, token-mean loss, Adam lr 1e-4, 1 thread):
held-out 0.288 -> 0.454 after 90 s -> 0.690 after 300 s (735 steps).

## Curve

| step | held-out acc | supervised-set acc | elapsed s |
|---:|---:|---:|---:|
{rows}
""")


if __name__ == "__main__":
    main()
