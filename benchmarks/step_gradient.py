"""Is sealrl's GRPO update TRL's? The gradient of one update of a finished run, sealrl's actor
against TRL's GRPO loss written out on the plain Hugging Face model.

The batch is the run's sealed iteration (its samples, masks and advantages, as trained). sealrl's
side is the actor's update forward and backward on the run's own path (the fast path unless the
run set run.exact), from the run's initial model (`model.path`). TRL's side is the loss
GRPOTrainer computes with loss_type="dapo" and num_iterations=1 (the ratio is 1, so the
clipped objective's gradient is the plain policy gradient): -sum over tokens of A_i log p_t,
divided by the batch's loss tokens, log p_t from the model's logits divided by the sampling
temperature, one sample at a time with no padding. Only the first update is comparable: its
weights are the initial model's on both sides.

    .venv/bin/python benchmarks/step_gradient.py runs/smollm2_learn      # iteration 0 of a run

The last line printed is JSON: both gradient norms, their cosine, and the largest difference of
any tensor relative to that tensor's largest entry; then the step each side takes with it (sealrl's
optimizer step against torch's AdamW as TRL's Trainer builds it for optim="adamw_torch", after
clip_grad_norm_ at actor.grad_clip): the norm of each update and of their difference.

    .venv/bin/python benchmarks/step_gradient.py RUN --replay            # every update of a run

`--replay` takes the whole run: from the initial model, TRL's loss and step (one AdamW throughout)
on each sealed batch of the run in turn, against the run's own final weights (RUN/model). The
batches are what sealrl sampled; so this asks whether, given those samples, TRL's trainer would
have ended where sealrl did (Adam's moments, clipping and the driver's bookkeeping included).
It reports both changes from the initial weights, the norm of their difference, that norm over
the run's change, and the cosine of the two changes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml

from sealrl.config import build_config
from sealrl.experience.store import iteration_path, read_iteration
from sealrl.models.hf import load_causal_lm
from sealrl.roles import common
from sealrl.roles.actor import Actor, loss_mask


def sealrl_side(cfg, batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(gradient, update): the actor's update forward and backward, then its optimizer step."""
    model, tok = load_causal_lm(cfg.model.path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    exact = cfg.run.exact
    tf = common.teacher_forcing(cfg.actor, model, exact=exact, group=cfg.rollout.n)
    actor = Actor(model, cfg.actor, cfg.algorithm, "step_gradient", "", cfg.rollout.temperature, tok.pad_token_id,
                  1, cfg.rollout.max_new_tokens, tf=tf, exact=exact)
    _, mask = loss_mask(batch, cfg.algorithm)
    model.train()
    totals = actor._accumulate(batch, torch.arange(len(batch)), batch.get("old_log_probs"),
                               batch.get("advantages"), mask, None, None, [])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    actor._step(totals, None)
    return grads, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def batch_rows(cfg, batch) -> tuple[list[tuple], int]:
    """A sealed batch as `loss_backward` rows (prompt ids, response ids, advantages, loss mask)
    and its loss-token count."""
    _, mask = loss_mask(batch, cfg.algorithm)
    adv = batch.get("advantages")
    rows = [(list(s.prompt_ids), list(s.response_ids), adv[i, :len(s.response_ids)],
             mask[i, :len(s.response_ids)]) for i, s in enumerate(batch.samples)]
    return rows, int(mask.sum())


def loss_backward(model, rows: list[tuple], tokens: int, temperature: float) -> None:
    """Accumulate the gradient of TRL's dapo loss at ratio 1, -sum A_t log p_t / tokens, into
    `model`'s .grad: one unpadded sample at a time, log p_t from the logits divided by `temperature`."""
    for prompt, response, adv, mask in rows:
        p, r = len(prompt), len(response)
        logits = model(input_ids=torch.tensor([[*prompt, *response]])).logits[0, p - 1:p - 1 + r]
        lp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(response)[:, None])
        (-(adv * lp.squeeze(-1) * mask.float()).sum() / tokens).backward()


def trl_optimizer(cfg, model) -> torch.optim.Optimizer:
    a = cfg.actor
    return torch.optim.AdamW(model.parameters(), lr=a.lr, betas=a.betas, eps=a.adam_eps, weight_decay=a.weight_decay)


def trl_side(cfg, batch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(gradient, update): TRL's loss, then the step its Trainer takes (clip, torch's AdamW)."""
    model, _ = load_causal_lm(cfg.model.path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    loss_backward(model, *batch_rows(cfg, batch), cfg.rollout.temperature)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip)
    trl_optimizer(cfg, model).step()
    return grads, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def trl_replay(cfg, steps: list[tuple[list[tuple], int]]) -> dict[str, torch.Tensor]:
    """The weights after TRL's loss and step on each step's (rows, tokens) in turn, from the
    initial model (cfg.model.path), one optimizer throughout."""
    model, _ = load_causal_lm(cfg.model.path)
    model.train()
    optimizer = trl_optimizer(cfg, model)
    for rows, tokens in steps:
        optimizer.zero_grad(set_to_none=True)
        loss_backward(model, rows, tokens, cfg.rollout.temperature)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip)
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def compare_changes(start, ours, theirs) -> dict:
    """Trained and replayed final weights from the same `start`: each change's norm, the norm of their
    difference, that over our change, and the cosine of the two changes."""
    ours_change, theirs_change = ({n: w[n] - start[n] for n in start} for w in (ours, theirs))
    difference = norm({n: ours[n] - theirs[n] for n in start})
    dot = sum(float((ours_change[n].double() * theirs_change[n].double()).sum()) for n in start)
    return {"change_norm_trained": round(norm(ours_change), 6), "change_norm_replayed": round(norm(theirs_change), 6),
            "difference_norm": float(f"{difference:.3g}"),
            "difference_over_change": float(f"{difference / norm(ours_change):.3g}"),
            "change_cosine": round(dot / (norm(ours_change) * norm(theirs_change)), 8)}


def replay_report(cfg, run: Path, iterations: int) -> dict:
    """The run's own final weights against TRL's loss and step replayed over all its batches."""
    if not (run / "model").is_dir():
        raise SystemExit(f"step_gradient --replay: {run} has no model/ (the final weights of a finished run)")
    batches = [read_iteration(iteration_path(run / "experience", it)) for it in range(iterations)]
    start = {n: p.detach() for n, p in load_causal_lm(cfg.model.path)[0].named_parameters()}
    ours = {n: p.detach() for n, p in load_causal_lm(run / "model")[0].named_parameters()}
    theirs = trl_replay(cfg, [batch_rows(cfg, b) for b in batches])
    return {"replayed_updates": iterations, **compare_changes(start, ours, theirs)}


def norm(t: dict[str, torch.Tensor]) -> float:
    return sum(float(v.double().pow(2).sum()) for v in t.values()) ** 0.5


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    if a.keys() != b.keys():
        raise SystemExit(f"step_gradient: the sides have gradients for other tensors: {sorted(a.keys() ^ b.keys())}")
    norm_a, norm_b = norm(a), norm(b)
    dot = sum(float((a[n].double() * b[n].double()).sum()) for n in a)
    worst = max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp(min=1e-30)) for n in a)
    return {"grad_norm_sealrl": round(norm_a, 6), "grad_norm_trl_loss": round(norm_b, 6),
            "cosine": round(dot / (norm_a * norm_b), 8), "max_rel_diff": float(f"{worst:.3g}")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished run's folder (config.yaml, experience/)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--replay", action="store_true",
                   help="replay every update of the run with TRL's loss and step; compare the final weights")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = build_config(yaml.safe_load((args.run / "config.yaml").read_text()), [])
    if cfg.actor.lora.rank or cfg.algorithm.kl_coef or cfg.actor.entropy_coef:
        raise SystemExit("step_gradient: compares the plain GRPO loss only (no LoRA, KL or entropy term)")
    if args.replay:
        if not (args.run / "summary.json").exists():
            raise SystemExit(f"step_gradient --replay: {args.run} has no summary.json (not a finished run)")
        summary = json.loads((args.run / "summary.json").read_text())
        print(json.dumps({"run": str(args.run), **replay_report(cfg, args.run, summary["iterations"])}))
        return
    batch = read_iteration(iteration_path(args.run / "experience", 0))
    (grad, ours), (trl_grad, theirs) = sealrl_side(cfg, batch), trl_side(cfg, batch)
    report = {"run": str(args.run), "samples": len(batch), "temperature": cfg.rollout.temperature,
              **compare(grad, trl_grad)}
    report.update(update_norm_sealrl=round(norm(ours), 7), update_norm_trl=round(norm(theirs), 7),
                  update_difference_norm=float(f"{norm({n: ours[n] - theirs[n] for n in ours}):.3g}"))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
