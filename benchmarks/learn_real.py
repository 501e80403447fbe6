"""A real model that learns, sealrl against TRL: GRPO on SmolLM2-135M-Instruct, held-out greedy
accuracy before, during and after, and training wall time, per side and seed.

Workload (both sides): SmolLM2-135M-Instruct (`make smollm2` converts it to
models/smollm2-135m-instruct), the generated one- and two-step arithmetic word problems of
benchmarks/learn_real_data.py (500 training, 200 held-out rows, seed 0, verl layout; each
prompt a system message, one worked example and the question, rendered by the model's chat
template), scored 1/0 by benchmarks/learn_real_reward.py:compute_score (the final number in
\\boxed{}, after "answer is", or at the end). Per step --prompts prompts x --n samples at
temperature --temperature (0.8; no top-k/top-p), up to --max-new-tokens new tokens, group-normalised
advantages, PPO-clip 0.2 token-mean loss (TRL's `dapo`), KL to the initial model with
coefficient --kl-coef (0: no reference model, as TRL's default beta), one AdamW step per batch
at a constant --lr, grad clip 1.0, fp32.

- sealrl: `train()` with only these workload keys set; every speed and memory key keeps
  sealrl's default. Held-out accuracy is its own evaluation (`eval/accuracy` in metrics.jsonl
  every --eval-every iterations, `accuracy_before`/`accuracy_after` in summary.json): greedy
  (top-k 1) decoding of the first --num-eval held-out rows through the rollout engine.
  Training time is `time/train_wall_s` (the sum of `time/iteration_s`, evaluation excluded).
- TRL: `GRPOTrainer` given the model folder. Held-out accuracy: Hugging Face `generate`,
  greedy, 64 rows a batch, left padding, the same chat template, rows, budget and reward, on
  the trained model before training, in a callback every --eval-every steps, and after.
  Training time is the sum of on_step_begin -> on_step_end (the callback evaluates after it
  has taken the step's time).
Evaluation seconds are reported apart (`eval_s`): they are not part of either side's
training time. Each side and seed runs in its own subprocess, seed by seed (sealrl, then TRL),
so a stopped run keeps whole pairs.

Prompt order (`--order`): `paired` (the default) gives TRL's trainer sealrl's order for the same
seed (sealrl's sampler permutation, epoch after epoch, with TRL's own shuffle off), so at every
step both sides train on the same prompts and a seed's two results differ only by what each side
does with them; each side records the prompt ids it trained on per step, the report says whether
they matched (`same_prompts`) and gives the paired difference of the final accuracies. `own`: each
side shuffles with its own sampler (the runs of sessions 18-20): the same rows, not the same order.
`paired_blocks` sets the two sides' per-step logs (training reward, entropy, response length,
gradient norm) against each other the same way, a block of --eval-every steps at a time.

Run (the last line printed is JSON; stderr gets the workload first, then each finished side and
seed as one line, so a stopped run keeps what it measured and --merge can read it;
on 2 idle CPU cores at the defaults sealrl takes about 10 minutes a seed and TRL about 35;
the whole run took 2 h 11 min in session 19, docs/benchmarks.md):
    .venv/bin/python benchmarks/learn_real.py --threads 2
    .venv/bin/python benchmarks/learn_real.py --iterations 2 --num-eval 8 --seeds 0 --threads 1   # smoke
    .venv/bin/python benchmarks/learn_real.py --write-data examples/learn_real/data   # data only
    .venv/bin/python benchmarks/learn_real.py --merge run1.log run2.err   # one report of both runs' seeds
The sealrl side alone is `sealrl train examples/smollm2_learn.yaml`. Needs the `bench` extra
for the TRL side (trl, datasets, accelerate).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Each side under its own defaults, set before torch loads: sealrl's the OpenMP wait its CLI sets
# (sealrl/cli.py), TRL's GNU OpenMP's own (as benchmarks/vs_trl.py).
if "--side" in sys.argv and sys.argv[sys.argv.index("--side") + 1:][:1] == ["sealrl"]:
    import sealrl.cli  # noqa: F401

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))   # the sibling modules, also when imported from elsewhere
import learn_real_data  # noqa: E402
from learn_real_reward import compute_score  # noqa: E402

REWARD_FN = f"{HERE / 'learn_real_reward.py'}:compute_score"
EVAL_BATCH = 64   # TRL side: held-out rows per generate call


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2", help="comma list of run seeds (both sides)")
    p.add_argument("--iterations", type=int, default=30, help="GRPO steps per side and seed")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="training sampling temperature")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--kl-coef", type=float, default=0.0, help="KL coefficient (TRL's beta)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between held-out evaluations")
    p.add_argument("--num-eval", type=int, default=200, help="held-out rows evaluated")
    p.add_argument("--order", choices=("paired", "own"), default="paired",
                   help="paired: TRL trains on sealrl's prompt order; own: each side shuffles its own way")
    p.add_argument("--skip", choices=("sealrl", "trl"), default=None, help="run one side only")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both sides")
    p.add_argument("--model-path", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--write-data", type=Path, default=None, metavar="DIR",
                   help="only write DIR/train.parquet and DIR/test.parquet, then exit")
    p.add_argument("--merge", type=Path, nargs="+", default=None, metavar="LOG",
                   help="only combine the reports of earlier runs (same workload, other seeds) into one")
    p.add_argument("--side", choices=("sealrl", "trl"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key in ("iterations", "prompts", "n", "max_new_tokens", "eval_every", "num_eval", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def curve_point(step: int, args, accuracy: float) -> list:
    """[samples seen, accuracy]: after `step` steps of prompts x n samples."""
    return [step * args.prompts * args.n, round(accuracy, 4)]


# ---- sealrl -------------------------------------------------------------------------------

def run_sealrl(args) -> dict:
    from sealrl.config import build_config
    from sealrl.experience.store import iteration_path, read_table
    from sealrl.obs.metrics import read_metrics
    from sealrl.trainer import driver

    eval_s = []
    timed_held_out = driver.held_out

    def held_out(*a, **k):   # the driver's evaluation, timed (it calls the module global)
        t0 = time.perf_counter()
        try:
            return timed_held_out(*a, **k)
        finally:
            eval_s.append(time.perf_counter() - t0)

    driver.held_out = held_out
    name = f"sealrl_seed{args.seed}"
    cfg = build_config(None, [   # the workload only: every speed and memory key at sealrl's default
        f"model.path={args.model_path}", f"run.output_dir={args.workdir}", f"run.name={name}",
        f"run.iterations={args.iterations}", f"run.eval_every={args.eval_every}", f"run.seed={args.seed}",
        f"run.threads={args.threads}", "run.loggers=",
        "run.checkpoint_every=0",   # one checkpoint at the end (TRL saves none); never in train time
        "data.task=file", f"data.train_file={args.data / 'train.parquet'}",
        f"data.eval_file={args.data / 'test.parquet'}", f"data.prompts_per_iter={args.prompts}",
        "data.max_prompt_tokens=256",   # system + example + question: ~125 tokens with ChatML
        f"rollout.n={args.n}", f"rollout.temperature={args.temperature}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "algorithm.name=grpo", f"algorithm.kl_coef={args.kl_coef}", f"actor.lr={args.lr}",
        f"reward.fn={REWARD_FN}", f"eval.num={args.num_eval}",
    ])
    summary = driver.train(cfg)
    rows = read_metrics(args.workdir / name)
    folder = args.workdir / name / "experience"
    prompts = [sorted({int(x) for x in read_table(iteration_path(folder, it))[0].column("prompt_id").to_pylist()})
               for it in range(summary["iterations"])]
    curve = [curve_point(0, args, summary["accuracy_before"])]
    curve += [curve_point(r["iteration"] + 1, args, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    curve.append(curve_point(summary["iterations"], args, summary["accuracy_after"]))
    return {"curve": curve, "train_wall_s": rows[-1]["time/train_wall_s"], "eval_s": sum(eval_s),
            "reward_mean": [round(r["reward/mean"], 4) for r in rows if "reward/mean" in r], "prompts": prompts,
            **per_step(rows, SEALRL_STEP_KEYS)}


# ---- TRL ----------------------------------------------------------------------------------

TRL_PROMPTS: list[list[int]] = []   # the prompt ids (extra_info.index) of each step TRL scored


# What each side logs a step, under one name: the gradient norm before clipping, the policy's
# entropy at the sampled tokens (at the training temperature), the mean response length in tokens.
SEALRL_STEP_KEYS = {"grad_norm": "actor/grad_norm", "entropy": "actor/entropy",
                    "response_len": "rollout/response_len_mean"}
TRL_STEP_KEYS = {"grad_norm": "grad_norm", "entropy": "entropy", "response_len": "completions/mean_length"}


def per_step(rows: list[dict], keys: dict[str, str]) -> dict[str, list[float]]:
    """{name: [value per step]} of the `keys` (name -> that side's log key) the rows have."""
    return {name: [round(float(r[key]), 4) for r in rows if key in r] for name, key in keys.items()}


def reward_rows(completions, ground_truth, index, **_) -> list[float]:
    """TRL's reward signature: conversational completions, the dataset's ground_truth and index
    columns. TRL scores once per step here (one generation batch a step), so each call is a step."""
    TRL_PROMPTS.append(sorted(set(index)))
    return [compute_score(learn_real_data.DATA_SOURCE, c[0]["content"], t) for c, t in zip(completions, ground_truth)]


def sealrl_order(rows: list[dict], seed: int, steps: int, per_step: int) -> list[dict]:
    """The rows of `steps` steps of `per_step` prompts in the order sealrl's sampler takes them at
    `seed`: its permutation of epoch 0, then of epoch 1, ... (trainer/setup.py:build_sampler
    shuffles with run.seed). sealrl's last step of an epoch is short when `per_step` does not
    divide the rows, which a fixed-size TRL step cannot follow: refused when the run gets there."""
    from sealrl.data.sampler import epoch_permutation
    needed = steps * per_step
    if needed > len(rows) and len(rows) % per_step:
        raise ValueError(f"paired order: {len(rows)} rows are not a whole number of {per_step}-prompt steps, "
                         f"and {steps} steps run past the first epoch")
    out: list[dict] = []
    epoch = 0
    while len(out) < needed:
        out += [rows[i] for i in epoch_permutation(len(rows), seed, epoch)]
        epoch += 1
    return out[:needed]


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Share of `rows` whose greedy completion (chat template, left padding) scores 1."""
    import torch
    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    solved = 0
    for start in range(0, len(rows), EVAL_BATCH):
        chunk = rows[start:start + EVAL_BATCH]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                 for r in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        for row, ids in zip(chunk, out[:, batch["input_ids"].shape[1]:]):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            solved += compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])
    model.train(was_training)
    return solved / len(rows)


def trl_trainer(args, callbacks: list):
    """(GRPOTrainer, tokenizer) of the TRL side's workload at args.seed: the training rows in the
    order --order gives, the config mirroring sealrl's workload; `callbacks` as given."""
    import pyarrow.parquet as pq
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    train_rows = pq.read_table(args.data / "train.parquet").to_pylist()
    if args.order == "paired":   # TRL's sampler then keeps this order (shuffle_dataset=False)
        train_rows = sealrl_order(train_rows, args.seed, args.iterations, args.prompts)
    data = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"],
                               "index": r["extra_info"]["index"]} for r in train_rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    config = GRPOConfig(
        output_dir=str(args.workdir / f"trl_seed{args.seed}"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False,   # TRL defaults it to True; sealrl to off
        per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1,
        num_generations=args.n, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        top_p=1.0, top_k=0, beta=args.kl_coef, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo",
        epsilon=0.2, num_iterations=1, max_steps=args.iterations, logging_steps=1, save_strategy="no",
        report_to="none", seed=args.seed, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        shuffle_dataset=args.order == "own")
    trainer = GRPOTrainer(model=str(args.model_path), reward_funcs=reward_rows, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)   # no per-step log dicts on stdout
    return trainer, tokenizer


def run_trl(args) -> dict:
    import pyarrow.parquet as pq
    from transformers import TrainerCallback

    eval_rows = pq.read_table(args.data / "test.parquet").to_pylist()[:args.num_eval]
    trainer = tokenizer = None

    class Clock(TrainerCallback):
        """Training time per step, then (outside it) the held-out evaluation every K steps."""

        def __init__(self):
            self.step_s, self.eval_s, self.curve, self._t0 = [], [], [], 0.0

        def evaluate(self, step: int) -> None:
            t0 = time.perf_counter()
            acc = greedy_accuracy(trainer.model, tokenizer, eval_rows, args.max_new_tokens)
            self.eval_s.append(time.perf_counter() - t0)
            self.curve.append(curve_point(step, args, acc))

        def on_step_begin(self, *a, **k):
            self._t0 = time.perf_counter()

        def on_step_end(self, _args, state, *a, **k):
            self.step_s.append(time.perf_counter() - self._t0)
            if state.global_step % args.eval_every == 0 and state.global_step < args.iterations:
                self.evaluate(state.global_step)

    clock = Clock()
    trainer, tokenizer = trl_trainer(args, [clock])
    clock.evaluate(0)
    trainer.train()
    clock.evaluate(len(clock.step_s))
    rows = [h for h in trainer.state.log_history if "reward" in h]   # one a step (logging_steps=1)
    return {"curve": clock.curve, "train_wall_s": sum(clock.step_s), "eval_s": sum(clock.eval_s),
            "reward_mean": [round(h["reward"], 4) for h in rows], "prompts": TRL_PROMPTS,
            **per_step(rows, TRL_STEP_KEYS)}


# ---- driver -------------------------------------------------------------------------------

def run_side(args) -> None:
    """Child process: one side, one seed; prints its result as one JSON line."""
    import torch
    torch.set_num_threads(args.threads)
    out = (run_sealrl if args.side == "sealrl" else run_trl)(args)
    curve = out["curve"]
    out.update(before=curve[0][1], after=curve[-1][1], gain_points=round(100 * (curve[-1][1] - curve[0][1]), 2),
               train_wall_s=round(out["train_wall_s"], 2), eval_s=round(out["eval_s"], 2))
    print(json.dumps(out))


def spawn_side(args, side: str, seed: int, data: Path, workdir: Path) -> dict:
    """One side and seed in a fresh subprocess; its stderr goes to ours (progress, warnings)."""
    cmd = [sys.executable, __file__, "--side", side, "--seed", str(seed), "--data", str(data),
           "--workdir", str(workdir), "--model-path", str(args.model_path), "--iterations", str(args.iterations),
           "--prompts", str(args.prompts), "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens),
           "--temperature", str(args.temperature), "--lr", str(args.lr), "--kl-coef", str(args.kl_coef),
           "--eval-every", str(args.eval_every), "--num-eval", str(args.num_eval), "--threads", str(args.threads),
           "--order", args.order]
    print(f"learn_real: {side}, seed {seed} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"learn_real: the {side} side (seed {seed}) failed with exit status {done.returncode}; "
                 "its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mean_over_seeds(results: list[dict]) -> dict:
    """The mean of each figure over seeds; the curve point by point (all seeds share the steps)."""
    keys = ("before", "after", "gain_points", "train_wall_s", "eval_s")
    out = {k: round(statistics.mean(r[k] for r in results), 4) for k in keys}
    out["curve"] = [[pts[0][0], round(statistics.mean(p[1] for p in pts), 4)]
                    for pts in zip(*(r["curve"] for r in results))]
    out["every_seed_gained"] = all(r["gain_points"] > 0 for r in results)
    return out


def main() -> None:
    args = parse_args()
    if args.side:
        return run_side(args)
    if args.merge:
        print(json.dumps(merge(args.merge)))
        return
    if args.write_data:
        train, test = learn_real_data.write(args.write_data)
        print(f"wrote {train} and {test}")
        return
    if not (args.model_path / "config.json").is_file():
        sys.exit(f"learn_real: no converted SmolLM2-135M-Instruct folder at {args.model_path} "
                 "(`make smollm2` makes models/smollm2-135m-instruct; or pass --model-path)")
    args.model_path = args.model_path.resolve()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    sides = [s for s in ("sealrl", "trl") if s != args.skip]
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                       if k not in ("side", "seed", "data", "workdir", "write_data", "merge")}}
    print(ARGS_LINE + json.dumps(report["args"]), file=sys.stderr, flush=True)   # a stopped run's workload
    with tempfile.TemporaryDirectory(prefix="learn_real_") as tmp:
        data = Path(tmp) / "data"
        learn_real_data.write(data)
        results = {side: [] for side in sides}
        for seed in seeds:   # seed by seed: a stopped run keeps whole pairs
            for side in sides:
                results[side].append({"seed": seed, **spawn_side(args, side, seed, data, Path(tmp))})
                print(f"learn_real: {side}, seed {seed}: {json.dumps(results[side][-1])}",
                      file=sys.stderr, flush=True)   # kept if a later seed is stopped
    print(json.dumps(finish(report, results)))


def finish(report: dict, results: dict[str, list[dict]]) -> dict:
    """The report: each side's seeds and their mean, and the two sides against each other."""
    for side, seeds in results.items():
        report[side] = {"seeds": seeds, "mean": mean_over_seeds(seeds)}
    if len(results) == 2:
        s, t = report["sealrl"]["mean"], report["trl"]["mean"]
        report["train_wall_ratio_trl_over_sealrl"] = round(t["train_wall_s"] / s["train_wall_s"], 3)
        report["after_minus_trl_points"] = round(100 * (s["after"] - t["after"]), 2)
        report.update(paired(results["sealrl"], results["trl"]))
        report["paired_blocks"] = paired_blocks(results["sealrl"], results["trl"], report["args"]["eval_every"])
    return report


def seed_pairs(sealrl: list[dict], trl: list[dict]) -> list[tuple[dict, dict]]:
    """(sealrl's result, TRL's result) for each seed both sides ran, in sealrl's order."""
    by_seed = {r["seed"]: r for r in trl}
    return [(s, by_seed[s["seed"]]) for s in sealrl if s["seed"] in by_seed]


def paired(sealrl: list[dict], trl: list[dict]) -> dict:
    """Seed by seed, for the seeds both sides ran: did they train on the same prompts at every
    step, and sealrl's final accuracy minus TRL's (points), with the mean and its standard error."""
    pairs = seed_pairs(sealrl, trl)
    if not pairs:
        return {}
    diffs = [round(100 * (s["after"] - t["after"]), 2) for s, t in pairs]
    out = {"paired_seeds": [s["seed"] for s, _ in pairs], "paired_after_minus_trl_points": diffs,
           "same_prompts": [s.get("prompts") is not None and s.get("prompts") == t.get("prompts") for s, t in pairs],
           "paired_mean_points": round(statistics.mean(diffs), 2)}
    if len(diffs) > 1:
        out["paired_stderr_points"] = round(statistics.stdev(diffs) / len(diffs) ** 0.5, 2)
    return out


BLOCK_KEYS = ("reward_mean", "entropy", "response_len", "grad_norm")   # per-step logs, both sides


def paired_blocks(sealrl: list[dict], trl: list[dict], block: int) -> dict:
    """Per-step logs of the paired seeds, sealrl minus TRL, averaged over each block of `block`
    steps: per block the seeds that logged it on both sides, the mean difference over them, its t
    (mean / standard error) and how many seeds are above 0. What sessions 25-28 tallied by hand."""
    pairs = seed_pairs(sealrl, trl)
    out = {}
    for key in BLOCK_KEYS:
        logged = [(s[key], t[key]) for s, t in pairs if s.get(key) and t.get(key)]
        rows = []
        for start in range(0, max((min(len(a), len(b)) for a, b in logged), default=0), block):
            diffs = [statistics.mean(a[start:start + block]) - statistics.mean(b[start:start + block])
                     for a, b in logged if min(len(a), len(b)) >= start + block]
            if len(diffs) < 2:
                continue
            se = statistics.stdev(diffs) / len(diffs) ** 0.5
            rows.append({"steps": f"{start + 1}-{start + block}", "seeds": len(diffs),
                         "mean": round(statistics.mean(diffs), 4),
                         "t": round(statistics.mean(diffs) / se, 2) if se > 0 else None,
                         "above": sum(d > 0 for d in diffs)})
        if rows:
            out[key] = rows
    return out


NOT_WORKLOAD = ("seeds", "skip", "merge", "merged", "unchecked")   # args that may differ between merged runs
SEED_LINE = re.compile(r"^learn_real: (sealrl|trl), seed (\d+): (\{.*\})$")   # a finished seed, on stderr
ARGS_LINE = "learn_real: args "   # a run's workload, first on stderr


def final_report(log: Path) -> dict:
    """The JSON report a run printed last (a log taken with 2>&1 has other lines too)."""
    report = _last_json(log.read_text().splitlines())
    if report is None:
        sys.exit(f"learn_real: {log} has no JSON line (a run's last line is its report)")
    return report


def _last_json(lines: list[str]) -> dict | None:
    reports = [x for x in lines if x.startswith("{")]
    return json.loads(reports[-1]) if reports else None


def read_run(log: Path) -> dict:
    """A run's report from its log: the final JSON line; for a run stopped before it (its stderr),
    the seeds it finished, each side's in order, and its workload when the log has it."""
    text = log.read_text().splitlines()
    if (final := _last_json(text)) is not None:
        return final
    report: dict = {"args": next((json.loads(x[len(ARGS_LINE):]) for x in text if x.startswith(ARGS_LINE)), None)}
    for side, seed, result in (m.groups() for x in text if (m := SEED_LINE.match(x))):
        report.setdefault(side, {"seeds": []})["seeds"].append(json.loads(result))
    if not any(side in report for side in ("sealrl", "trl")):
        sys.exit(f"learn_real: {log} has neither a report nor a finished seed")
    return report


def merge(logs: list[Path]) -> dict:
    """One report from several runs of the same workload (other seeds): every seed of each side,
    in the order given. A run is read from its final JSON line, or, stopped before it, from the
    seeds it finished (its stderr). Refuses runs whose workload differs or that share a seed; a
    stopped run from before its stderr named the workload is listed as `unchecked`."""
    reports = [read_run(log) for log in logs]
    full = [r["args"] for r in reports if r["args"] is not None]
    if not full:
        sys.exit("learn_real: no log names its workload (a finished run's report, or a run's stderr)")
    workload = {k: v for k, v in full[0].items() if k not in NOT_WORKLOAD}
    results: dict[str, list[dict]] = {}
    for log, r in zip(logs, reports):
        other = workload if r["args"] is None else {k: v for k, v in r["args"].items() if k not in NOT_WORKLOAD}
        if other != workload:
            diff = sorted(k for k in set(other) | set(workload) if other.get(k) != workload.get(k))
            sys.exit(f"learn_real: {log} ran another workload than the first log that names one ({', '.join(diff)})")
        for side in ("sealrl", "trl"):
            for seed in r.get(side, {}).get("seeds", []):
                if any(x["seed"] == seed["seed"] for x in results.get(side, [])):
                    sys.exit(f"learn_real: {log} repeats {side} seed {seed['seed']}")
                results.setdefault(side, []).append(seed)
    seeds = sorted({x["seed"] for side in results.values() for x in side})
    unchecked = [str(log) for log, r in zip(logs, reports) if r["args"] is None]
    return finish({"args": {**workload, "seeds": ",".join(map(str, seeds)), "merged": [str(x) for x in logs],
                            **({"unchecked": unchecked} if unchecked else {})}}, results)


if __name__ == "__main__":
    main()
