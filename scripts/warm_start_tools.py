"""Supervised warm start of the embedded tiny Llama for the calculator tool task (data.task=mul3).

What it teaches: the call format, not when to call. Each supervised problem "123*456=" is
written one of two ways, chosen by a hash of the problem: with probability --p-tool as a tool
episode, `<calc>123*456</calc>` + the tool's `<out>56088</out>` + `56088<eos>`, otherwise as a
direct answer `56088<eos>`. The loss covers policy tokens only (the call and the answers);
the observation is masked exactly as RL masks it. A 1M-parameter model cannot multiply 3-digit
numbers, so the direct answers are nearly always wrong; the tool path is right when the model
copies the operands into the call and the result out of the observation. The warm start thus
calls the tool in about --p-tool of its samples and, greedily, mostly answers directly: what RL
has to learn is to use the tool.

Held-out evaluation runs the real multi-turn rollout (sealrl.rollout.episodes with the calc
environment) greedily on 200 test-split problems, and reports the share of episodes that
called the tool and the accuracy of those that did.

Run (12 minutes on 2 heavily shared CPU cores, 1 thread):
    .venv/bin/python scripts/warm_start_tools.py --out sealrl/assets/arith-tools
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sealrl.data.dataset import prompts_from_rows  # noqa: E402
from sealrl.data.sampler import PromptSampler  # noqa: E402
from sealrl.data.tasks import make_task  # noqa: E402
from sealrl.models.hf import model_config_hash, tokenizer_hash  # noqa: E402
from sealrl.models.tiny import build_tiny_model  # noqa: E402
from sealrl.rewards.episodes import ToolAnswerMatch  # noqa: E402
from sealrl.roles.rollout import Rollout  # noqa: E402
from sealrl.rollout.episodes import EpisodeSpec  # noqa: E402
from sealrl.sync.manifest import build_manifest  # noqa: E402
from sealrl.trainer.evaluate import evaluate  # noqa: E402

SPEC = EpisodeSpec("calc", max_turns=2, max_tokens=64, max_observation_tokens=24)
MAX_NEW_TOKENS = 24   # per turn, as examples/arith_tools.yaml


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-num", type=int, default=2000)
    p.add_argument("--p-tool", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=900)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--eval-num", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def uses_tool(prompt_id: str, p_tool: float) -> bool:
    h = int.from_bytes(hashlib.sha256(f"tool|{prompt_id}".encode()).digest()[:8], "big")
    return h % 1_000_000 < round(p_tool * 1_000_000)


def transcript(tok, prompt, tool: bool) -> tuple[list[int], list[int]]:
    """(response ids, labels): the observation is -100, like an RL observation hole."""
    enc = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    answer = enc(prompt.ground_truth) + [tok.eos_token_id]
    if not tool:
        return answer, answer
    call, obs = enc(f"<calc>{prompt.text.rstrip('=')}</calc>"), enc(f"<out>{prompt.ground_truth}</out>")
    return call + obs + answer, call + [-100] * len(obs) + answer


def batch_of(prompts, responses, pad_id: int) -> dict:
    seqs = [list(p.token_ids) + r[0] for p, r in zip(prompts, responses)]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (p, s, (_, lab)) in enumerate(zip(prompts, seqs, responses)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        labels[i, len(p.token_ids):len(s)] = torch.tensor(lab)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def held_out(model, tok, test) -> dict:
    """Greedy multi-turn evaluation with the calculator: accuracy, tool-call share."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manifest = build_manifest(state, "warm", 0, 0, tokenizer_hash(tok), model_config_hash(model.config))
    rollout = Rollout(model, tok, episodes=SPEC)
    try:
        rollout.load(state, manifest)
        acc = evaluate(rollout, manifest.version, test, ToolAnswerMatch(), tok, MAX_NEW_TOKENS, len(test))
    finally:
        rollout.episodes.close()
    return {"heldout_acc": acc["eval/accuracy"]}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.time()
    model, tok = build_tiny_model(seed=args.seed)
    sft = prompts_from_rows(make_task("mul3", "train", args.sft_num, 0), tok, 32).prompts
    test = prompts_from_rows(make_task("mul3", "test", args.eval_num, 1234), tok, 32)
    responses = [transcript(tok, p, uses_tool(p.prompt_id, args.p_tool)) for p in sft]
    sampler = PromptSampler(len(sft), args.batch_size, seed=args.seed, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    batches, curve = iter(sampler), []
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            curve.append({"step": step, **held_out(model, tok, test), "elapsed_s": round(time.time() - t0, 1)})
            print(json.dumps(curve[-1]), flush=True)
            model.train()
        if step == args.steps:
            break
        idx = next(batches)
        loss = model(**batch_of([sft[i] for i in idx], [responses[i] for i in idx], tok.pad_token_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    wall = time.time() - t0
    print(json.dumps({"final": curve[-1], "wall_s": round(wall, 1)}), flush=True)
    if args.out is not None:
        save(args, model, tok, curve, wall)


def save(args, model, tok, curve, wall) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    (args.out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    rows = "\n".join(f"| {c['step']} | {c['heldout_acc']:.3f} | {c['elapsed_s']} |" for c in curve)
    command = " ".join([".venv/bin/python", "scripts/warm_start_tools.py", *sys.argv[1:]])
    title = "# arith-tools: warm start for the calculator task (scripts/warm_start_tools.py)"
    (args.out / "WARM_START.md").write_text(f"""{title}

Command: `{command}`

- model: `build_tiny_model(seed={args.seed})`, char tokenizer; torch {torch.__version__}, {args.threads} thread(s)
- data: `make_task("mul3", "train", {args.sft_num}, 0)`; a hash of each problem picks the tool
  transcript (p = {args.p_tool}) or the direct answer; loss on policy tokens only (observation masked)
- AdamW lr {args.lr}, batch {args.batch_size}, {args.steps} steps
- held-out: `make_task("mul3", "test", {args.eval_num}, 1234)`, greedy, multi-turn with the calc
  environment ({SPEC}), max_new_tokens={MAX_NEW_TOKENS} per turn

**Final held-out accuracy (greedy, tool available): {curve[-1]['heldout_acc']:.3f}**, wall {wall:.0f} s
(2 shared CPU cores, other jobs running).

| step | held-out acc | elapsed s |
|---:|---:|---:|
{rows}
""")


if __name__ == "__main__":
    main()
