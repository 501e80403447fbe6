"""Do sealrl's rollout engine and Hugging Face `generate` (as TRL's GRPOTrainer calls it) sample
from the same distribution? One policy, many samples, one judge.

Input: a sealed experience file of iteration 0 (sampled by the initial weights), e.g. from
    .venv/bin/sealrl train examples/smollm2_learn.yaml run.iterations=1 data.prompts_per_iter=64 \
        run.output_dir=/tmp/samp run.name=s0 eval.num=0 run.eval_every=0
    .venv/bin/python benchmarks/sampler_check.py /tmp/samp/s0/experience/iter_000000.parquet

For the same prompt ids (the file's), `generate` draws as many samples per prompt with the
GenerationConfig TRL 1.16 builds (do_sample, the file's temperature, top-p 1, top-k 0, the
tokenizer's eos). Both sides' responses are then scored by one judge: a plain fp32 HF forward of
prompt + response, log_softmax(logits / T). Per side it reports:

- `surprisal_minus_entropy`: per response, the sum over its tokens of -log p(token) - H(p) at that
  position. If the tokens were drawn from p, every term has mean 0 given the past, so the mean
  over responses is 0 (`z` is it in standard errors). A sampler that draws from a sharper or
  flatter distribution than p (a wrong temperature, a truncation, a biased draw) moves it.
- `pit_ks`: the Kolmogorov-Smirnov distance of the randomised probability integral transform of
  every sampled token (F(x-1) + V p(x), V uniform) from the uniform, with its p-value.
- response length, the fraction ended by eos, the mean entropy per token, and the mean reward:
  sealrl's as its run recorded it, generate's by benchmarks/learn_real_reward.py (the reward of
  examples/smollm2_learn.yaml; a run with another reward compares this column across scorers).
- sealrl only: the largest |recorded behaviour log-prob - the judge's| (the sampler's own record).
The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_real_reward import compute_score  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experience", type=Path, help="iteration 0's sealed experience file")
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=0, help="only the file's first K prompts (0: all)")
    p.add_argument("--judge-temperature", type=float, default=None,
                   help="judge at this temperature instead of the sampling one (a check that must fail)")
    return p.parse_args(argv)


def load_samples(path: Path) -> tuple[list[dict], dict]:
    from sealrl.experience.store import read_table
    table, _ = read_table(path)
    rows = table.to_pylist()
    contract = json.loads(rows[0]["sampling"])
    return rows, contract


def judge(model, prompt: list[int], responses: list[list[int]], temperature: float,
          gen: torch.Generator) -> list[dict]:
    """Score each response after `prompt` under p = softmax(logits / T) of `model`."""
    width = max(len(r) for r in responses)   # right padding: a causal model's earlier positions ignore it
    ids = torch.tensor([prompt + r + [0] * (width - len(r)) for r in responses])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1].float() / temperature
    out = []
    for row, resp in zip(logits, responses):
        logp = torch.log_softmax(row[:len(resp)], -1)
        p = logp.exp()
        tok = torch.tensor(resp)
        lp = logp.gather(1, tok[:, None])[:, 0]
        entropy = -(p * logp).sum(-1)
        before = (torch.cumsum(p, -1) - p).gather(1, tok[:, None])[:, 0]
        pit = before + torch.rand(len(resp), generator=gen, dtype=torch.float32) * lp.exp()
        out.append({"log_probs": lp, "entropy": entropy, "pit": pit.clamp(0, 1)})
    return out


def hf_samples(model, tokenizer, prompts: dict[str, list[int]], n: int, contract: dict,
               max_new_tokens: int, seed: int) -> dict[str, list[list[int]]]:
    from transformers import GenerationConfig
    cfg = GenerationConfig(   # what TRL 1.16's GRPOTrainer builds for transformers generate
        max_new_tokens=max_new_tokens, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=[tokenizer.eos_token_id],
        temperature=contract["temperature"], top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        disable_compile=True)
    torch.manual_seed(seed)
    out = {}
    for pid, prompt in prompts.items():
        ids = torch.tensor([prompt] * n)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        resps = []
        for row in seqs[:, len(prompt):].tolist():
            if tokenizer.eos_token_id in row:   # keep the eos, drop the padding after it
                row = row[:row.index(tokenizer.eos_token_id) + 1]
            resps.append(row)
        out[pid] = resps
    return out


def ks_uniform(u: np.ndarray) -> tuple[float, float]:
    """Kolmogorov-Smirnov distance of `u` from U(0, 1), and its asymptotic p-value."""
    u, n = np.sort(u), len(u)
    i = np.arange(1, n + 1)
    d = float(max((i / n - u).max(), (u - (i - 1) / n).max()))
    x = d * math.sqrt(n)
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def mean_z(d: np.ndarray) -> dict:
    """The mean of per-response sums of surprisal - entropy, its standard error and z (mean / se)."""
    se = float(d.std(ddof=1) / math.sqrt(len(d)))
    return {"mean_per_response": round(float(d.mean()), 4), "se": round(se, 4), "z": round(float(d.mean()) / se, 2)}


def side_stats(scored: list[dict], responses: list[list[int]], rewards: list[float], eos: int) -> dict:
    d = np.array([float((-s["log_probs"] - s["entropy"]).sum()) for s in scored])
    pit = torch.cat([s["pit"] for s in scored]).numpy()
    ks_stat, ks_p = ks_uniform(pit)
    tokens = sum(len(r) for r in responses)
    return {
        "responses": len(responses), "tokens": tokens,
        "mean_length": round(tokens / len(responses), 2),
        "eos_fraction": round(sum(r[-1] == eos for r in responses) / len(responses), 4),
        "reward_mean": round(float(np.mean(rewards)), 4),
        "entropy_per_token": round(float(torch.cat([s["entropy"] for s in scored]).mean()), 4),
        "surprisal_minus_entropy": mean_z(d),
        "pit_ks": {"statistic": round(ks_stat, 5), "p_value": round(ks_p, 4)},
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    rows, contract = load_samples(args.experience)
    temperature, max_new = contract["temperature"], contract["max_new_tokens"]
    judged_at = temperature if args.judge_temperature is None else args.judge_temperature
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eos = tokenizer.eos_token_id
    prompts: dict[str, list[int]] = {}
    by_prompt: dict[str, list[dict]] = {}
    for r in rows:
        prompts.setdefault(r["prompt_id"], list(r["prompt_ids"]))
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    if args.prompts:
        keep = set(list(prompts)[:args.prompts])
        prompts = {k: v for k, v in prompts.items() if k in keep}
        by_prompt = {k: v for k, v in by_prompt.items() if k in keep}
    n = len(by_prompt[next(iter(by_prompt))])
    gen = torch.Generator().manual_seed(args.seed)
    report = {"experience": str(args.experience), "temperature": temperature, "judge_temperature": judged_at,
              "max_new_tokens": max_new, "prompts": len(prompts), "samples_per_prompt": n}

    # sealrl's samples, judged; and the sampler's own log-probs against the judge's
    s_scored, s_resps, s_rewards, worst = [], [], [], 0.0
    for pid, group in by_prompt.items():
        resps = [list(r["response_ids"]) for r in group]
        scored = judge(model, prompts[pid], resps, judged_at, gen)
        for r, sc in zip(group, scored):
            if r.get("rollout_log_probs") is not None:
                worst = max(worst, float((torch.tensor(r["rollout_log_probs"]) - sc["log_probs"]).abs().max()))
        s_scored += scored
        s_resps += resps
        s_rewards += [r["reward_total"] for r in group]
    report["sealrl"] = side_stats(s_scored, s_resps, s_rewards, eos)
    report["sealrl"]["max_abs_recorded_minus_judge"] = worst

    # generate's samples of the same prompts, judged the same way
    hf = hf_samples(model, tokenizer, prompts, n, contract, max_new, args.seed)
    h_scored, h_resps, h_rewards = [], [], []
    for pid, resps in hf.items():
        h_scored += judge(model, prompts[pid], resps, judged_at, gen)
        h_resps += resps
        gt = json.loads(by_prompt[pid][0]["ground_truth"])   # stored JSON-encoded
        h_rewards += [compute_score("learn_real", tokenizer.decode(r, skip_special_tokens=True), gt)
                      for r in resps]
    report["hf_generate"] = side_stats(h_scored, h_resps, h_rewards, eos)
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
