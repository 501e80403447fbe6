"""One iteration of the driver vs a plain loop-based reference written here, without
sealrl.algos: same advantages, loss, gradient norm and updated parameters (fp32; the gradient's
tolerances are derived from its rounding, `_rounding`, so they hold on every CPU).

The reference reads the sealed facts the driver stored (tokens, rewards, stop reasons), then
recomputes everything from the initial weights with per-sequence forwards and Python loops."""
import json
import math
from collections import defaultdict

import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from sealrl.config import EMBEDDED_MODEL, build_config
from sealrl.trainer.driver import train

# Adam's first step is lr * g / (|g| + eps): for gradients near eps, fp32 summation order
# (batched vs one sequence at a time) moves the update by up to ~lr * 3%. A larger eps keeps the
# comparison well-conditioned; lr 1e-4 keeps any wrong sign or scale far above 1e-6.
LR, BETAS, ADAM_EPS, MAX_NORM, CLIP = 1e-4, (0.9, 0.999), 1e-6, 1.0, 0.2


def _run(tmp_path, *extra):
    cfg = build_config(None, [
        f"run.output_dir={tmp_path}", "run.name=ref", "run.iterations=1",
        "data.num_train=64", "eval.num=8", "data.prompts_per_iter=6", "rollout.n=4",
        "rollout.max_new_tokens=5", "actor.micro_batch_size=7", f"actor.lr={LR}",
        f"actor.adam_eps={ADAM_EPS}", "run.seed=3", *extra])
    train(cfg)
    run = tmp_path / "ref"
    rows = pq.read_table(run / "experience" / "iter_000000.parquet").to_pylist()
    metrics = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    return run, rows, metrics


def _token_log_probs(model, row):
    """Log-probs of each response token, one sequence at a time: logits at position P-1+t."""
    ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
    logits = model(ids).logits[0]
    p = len(row["prompt_ids"])
    return [torch.log_softmax(logits[p - 1 + t], -1)[tok] for t, tok in enumerate(row["response_ids"])]


def _clip_and_adamw(params, lr):
    """clip_grad_norm_ then the first AdamW step (m, v start at 0), by hand."""
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    with torch.no_grad():
        for p in params:
            g = p.grad * coef
            m, v = (1 - BETAS[0]) * g, (1 - BETAS[1]) * g * g
            m_hat, v_hat = m / (1 - BETAS[0]), v / (1 - BETAS[1])
            p.copy_(p - lr * m_hat / (v_hat.sqrt() + ADAM_EPS))
    return norm


def _ppo_token_loss(lp, old, a):
    ratio = torch.exp(lp - old)
    return torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))


def _rounding(params, row_losses) -> tuple[float, list[torch.Tensor]]:
    """How far the actor's fp32 gradient may honestly sit from this reference's: (bound on the
    gap of the gradient norms, bound on each element's gap).

    Both sum the same per-row gradients in a different order (here row by row, in the actor
    batched), so an element's rounding is at most about unit roundoff (2^-24) x the longest fp32
    accumulation in it (the largest dimension: the FFN width, 512, for the embedded model) x
    sum_r |g_r| elementwise, its size before rows of opposite advantage cancel; by
    |‖a‖ - ‖b‖| <= ‖a - b‖ the norms differ by at most the same bound on sum_r ‖g_r‖. A
    fixed tolerance held on one CPU and failed on another (grad norm 2.9e-5 relative apart on an
    Intel Xeon against 1e-5); this one is ~2e-4 relative there, while a row dropped or
    misweighted would move the norm by ~‖g_r‖ ~ 0.2."""
    scale = 2.0 ** -24 * max(max(p.shape) for p in params)
    norm_bound, element_bound = 0.0, [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for loss in row_losses:
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        norm_bound += scale * math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads if g is not None))
        for bound, g in zip(element_bound, grads):
            if g is not None:
                bound += scale * g.double().abs()
    return norm_bound, element_bound


def _assert_params(params, names, path, element_bound, norm, lr):
    """The parameters after the first AdamW step within 1e-6 plus what the gradients' rounding
    gap can move them: the step is lr * g / (|g| + eps), whose slope in g is lr * eps / (|g| + eps)^2
    (largest near g = 0: a gradient element of rounding size moves its weight by up to ~lr * gap / eps)."""
    saved = load_file(str(path))
    coef = min(1.0, MAX_NORM / (norm + 1e-6))   # the clip scales gradient and gap alike
    for name, p, bound in zip(names, params, element_bound):
        g, gap = coef * p.grad.double().abs(), coef * bound
        slack = lr * gap * ADAM_EPS / ((g - gap).clamp(min=0) + ADAM_EPS) ** 2
        over = (p.detach().double() - saved[name].double()).abs() - (1e-6 + slack)
        assert float(over.max()) <= 0, f"{name}: {float(over.max())} past its bound"


def test_grpo_iteration_matches_plain_reference(tmp_path):
    run, rows, metrics = _run(tmp_path, "algorithm.name=grpo")
    # advantages: group mean and unbiased std by group id; zero-variance groups give 0
    scores = defaultdict(list)
    for r in rows:
        scores[r["group_id"]].append(r["reward_total"])
    assert 0 < sum(r["reward_total"] for r in rows) < len(rows), "need groups with signal"
    advs = []
    for r in rows:
        xs = scores[r["group_id"]]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        advs.append(0.0 if max(xs) == min(xs) else (r["reward_total"] - mean) / (std + 1e-6))
    for r, a in zip(rows, advs):
        assert all(abs(x - a) <= 1e-6 for x in r["advantages"]), (r["advantages"], a)
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    total_tokens = sum(len(r["response_ids"]) for r in rows)
    row_losses = []
    for r, a in zip(rows, advs):
        row_losses.append(torch.zeros(()))
        for t, lp in enumerate(_token_log_probs(model, r)):
            assert abs(float(lp.detach()) - r["old_log_probs"][t]) <= 1e-5
            row_losses[-1] = row_losses[-1] + _ppo_token_loss(lp, lp.detach(), a) / total_tokens
    names, params = zip(*model.named_parameters())
    tol, bounds = _rounding(params, row_losses)
    loss = sum(row_losses)
    loss.backward()
    assert abs(float(loss) - metrics["actor/pg_loss"]) <= 1e-6
    norm = _clip_and_adamw(list(params), LR)
    assert abs(norm - metrics["actor/grad_norm"]) <= tol, (norm, metrics["actor/grad_norm"], tol)
    _assert_params(params, names, run / "checkpoints" / "step_1" / "actor_model.safetensors", bounds, norm, LR)


def test_ppo_iteration_matches_plain_reference(tmp_path):
    critic_lr, gamma, lam = 3e-4, 0.9, 0.8
    run, rows, metrics = _run(tmp_path, "algorithm.name=ppo", f"critic.lr={critic_lr}",
                              f"algorithm.gamma={gamma}", f"algorithm.lam={lam}")
    from sealrl.models.critic import CriticModel
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)
    torch.manual_seed(3 + 1)   # the driver seeds the critic's new value head with run.seed + 1
    critic = CriticModel.from_causal_lm(model)
    total_tokens = sum(len(r["response_ids"]) for r in rows)
    value_rows, pg_rows = [], []
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
        hidden = critic.backbone(input_ids=ids).last_hidden_state[0]
        p, n = len(r["prompt_ids"]), len(r["response_ids"])
        v = [critic.value_head(hidden[p - 1 + t]).squeeze() for t in range(n + 1)]  # V(s_0..s_n)
        for t in range(n):
            assert abs(float(v[t]) - r["values"][t]) <= 1e-5
        # GAE by hand: reward at the last token; bootstrap V(s_n) only when truncated
        rewards = [0.0] * n
        rewards[-1] = r["reward_total"]
        next_v = 0.0 if r["stop_reason"] in ("eos", "stop") else float(v[n])
        adv, a = [0.0] * n, 0.0
        for t in reversed(range(n)):
            nv = next_v if t == n - 1 else float(v[t + 1])
            a = rewards[t] + gamma * nv - float(v[t]) + gamma * lam * a
            adv[t] = a
        value_rows.append(torch.zeros(()))
        for t in range(n):
            assert abs(adv[t] - r["advantages"][t]) <= 1e-5
            ret = adv[t] + float(v[t])
            value_rows[-1] = value_rows[-1] + 0.5 * (v[t] - ret) ** 2 / total_tokens
        pg_rows.append(sum(_ppo_token_loss(lp, lp.detach(), adv[t]) / total_tokens
                           for t, lp in enumerate(_token_log_probs(model, r))))
    c_names, c_params = zip(*critic.named_parameters())
    a_names, a_params = zip(*model.named_parameters())
    c_tol, c_bounds = _rounding(c_params, value_rows)
    a_tol, a_bounds = _rounding(a_params, pg_rows)
    value_loss, pg_loss = sum(value_rows), sum(pg_rows)
    value_loss.backward()
    pg_loss.backward()
    assert abs(float(value_loss) - metrics["critic/value_loss"]) <= 1e-6
    assert abs(float(pg_loss) - metrics["actor/pg_loss"]) <= 1e-6
    c_norm = _clip_and_adamw(list(c_params), critic_lr)
    a_norm = _clip_and_adamw(list(a_params), LR)
    assert abs(c_norm - metrics["critic/grad_norm"]) <= c_tol, (c_norm, metrics["critic/grad_norm"], c_tol)
    assert abs(a_norm - metrics["actor/grad_norm"]) <= a_tol, (a_norm, metrics["actor/grad_norm"], a_tol)
    step = run / "checkpoints" / "step_1"
    _assert_params(a_params, a_names, step / "actor_model.safetensors", a_bounds, a_norm, LR)
    _assert_params(c_params, c_names, step / "critic_model.safetensors", c_bounds, c_norm, critic_lr)
