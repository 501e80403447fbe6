"""One GRPO iteration, sealrl against TRL's GRPOTrainer: same model, prompts, settings, machine.

Workload (both sides): the embedded warm start `sealrl/assets/arith-tiny` (1.07M-parameter
Llama, char tokenizer), prompts of the embedded task (`sealrl.data.tasks.EMBEDDED_TASK`, chat
template applied), 16 prompts x 8 completions per step, up to --max-new-tokens new tokens,
temperature 1.0 (no top-k/top-p), reward 1/0 exact match of the arithmetic answer, group-normalised
advantages, PPO-clip 0.2 token-mean loss (TRL's default `dapo`), KL to a frozen reference model
(k3 in the loss, beta 0.04), one AdamW step per batch at a constant lr 1e-4, grad clip 1.0, fp32,
no bf16, no gradient checkpointing. TRL runs the whole 128-sample batch in one forward/backward
(per_device_train_batch_size); sealrl runs its default micro-batches (the fewest equal runs of
whole groups of at most 8,192 tokens: one at tiny and smollm2, two of 64 samples at mid).
--micro-batch M sets a smaller micro-batch on both sides, one optimizer step per batch still:
sealrl's `actor.micro_batch_size=M`, TRL's per_device_train_batch_size=M with
gradient_accumulation_steps=B/M (TRL then generates the B samples once and accumulates B/M
micro-batches; it still runs no old-log-prob forward, nor does sealrl).

- sealrl: `train()` with the config below; per-iteration times are `time/iteration_s` of its
  metrics.jsonl (generation, reward, reference, old log-probs, update, weight sync, writing the
  sealed experience). sealrl runs its default `algorithm.old_log_prob=recompute` unless
  --old-log-prob bypass is given; with one update step per batch (this workload) its recompute
  pass is the update's own forward and backward, run once (sealrl.roles.actor), as in TRL.
- TRL: `GRPOTrainer` given the model folder (it rebuilds the reference model from it);
  per-step times are on_step_begin -> on_step_end of a callback (generation, reward,
  reference, update). With num_iterations=1 TRL takes the old log-probs from the update's own
  forward, so it runs no old-log-prob forward.
Each side runs in its own subprocess (so `peak_rss_mib`, the side's max RSS, is its own), one
after the other, with the same torch thread count and each under its own OpenMP defaults
(sealrl's CLI bounds the spin of idle OpenMP threads, GOMP_SPINCOUNT=3000; TRL runs with GNU
OpenMP's default; an OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment applies to both); the
first --warmup steps of each are excluded and the median of the rest is reported. With --rounds
R the pair (sealrl, then TRL, each from scratch) runs R times and the timed steps are pooled, so
that load from other processes on a shared machine drifts over both sides alike.

Shapes (--shape): `tiny` the embedded model above; `mid` a random-init Qwen2 layout (GQA,
tied embeddings, 16,384-token vocabulary, 15.7M parameters; benchmarks/shapes.py), whose
responses run to --max-new-tokens (64); `llama` a random-init layout none of the other shapes
has, to check that the speed carries past the benchmark's own shapes (untied LM head, 32,000-token
vocabulary, full multi-head attention, 45.4M parameters; benchmarks/shapes.py), run at 128 new
tokens; `qwenvocab` the mid layout with Qwen2.5's 151,936-token vocabulary (tied head, 67.8M
parameters); `smollm2` the converted SmolLM2-135M-Instruct folder
(--model-path, default models/smollm2-135m-instruct; skipped with a reason when absent) with
its own tokenizer and chat template, 4 prompts x 8 unless --prompts says otherwise. sealrl
runs its defaults, no speed key set: the fast path (roles/common.teacher_forcing: the lean
forward with each group's prompt run once, the LM head 1024 tokens at a time with its logits
kept, fused AdamW). --sealrl-set adds sealrl overrides, e.g. run.exact=true (the bitwise HF
path) or actor.dtype=bf16.

Useful model FLOPs per step (N = number of model parameters, P_g = prompt tokens of group g,
R_i = response tokens of sample i, T = sum_g P_g + sum_i R_i: a group's n samples share their
prompt, so its tokens are needed once per group in every pass):

    F = 2 N T                               generation (a prompt is prefilled once per group)
      + 2 N T                               reference log-probs
      + 6 N T                               policy update (forward + backward)

Counting the prompt once per group is what a pass that shares it computes (sealrl's fast
path); a side that runs each sample's own copy of its
prompt does more work than F counts. Until session 9 the teacher-forced passes counted every
sample's copy (T = sum_i (P_i + R_i)), which gives a higher frac_of_matmul for the same time.

No side runs a separate old-log-prob forward here: with one update step per batch both take
the old log-probs from the update's own forward.

`useful_gflops` = F / median step time / 1e9, and `frac_of_matmul` = that / this machine's fp32
matmul throughput at the same thread count (median of 15 1024x1024x1024 matmuls, measured before and after the
runs; the higher of the two medians, as other processes only ever lower it).
`ratio` = TRL median step time / sealrl median step time.

Run:
    .venv/bin/python benchmarks/vs_trl.py --max-new-tokens 16 --steps 30 --threads 2
    .venv/bin/python benchmarks/vs_trl.py --max-new-tokens 64 --steps 30 --threads 2
    .venv/bin/python benchmarks/vs_trl.py --shape mid --max-new-tokens 64 --steps 4 --warmup 1 --rounds 1
    .venv/bin/python benchmarks/vs_trl.py --shape llama --max-new-tokens 128 --steps 3 --warmup 1 --rounds 1
    .venv/bin/python benchmarks/vs_trl.py --shape mid --max-new-tokens 64 --steps 4 --warmup 1 --micro-batch 32
    .venv/bin/python benchmarks/vs_trl.py --shape qwenvocab --max-new-tokens 64 --steps 3 --warmup 1 --rounds 1
Needs the `bench` extra (`pip install -e .[bench]`: trl, datasets, accelerate). The last line
printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Each side runs under its own defaults, set before torch loads: sealrl's under the OpenMP wait
# its CLI sets (sealrl/cli.py), TRL's under GNU OpenMP's own, which a TRL script gets. (Until
# session 17 both ran with OMP_WAIT_POLICY=PASSIVE, which slowed each side's small ops.)
if "--side" in sys.argv and sys.argv[sys.argv.index("--side") + 1:][:1] == ["sealrl"]:
    import sealrl.cli  # noqa: F401

import torch  # noqa: E402

from sealrl.data.tasks import EMBEDDED_TASK  # noqa: E402
from sealrl.rewards.verifiers import answer_text  # noqa: E402

PROMPTS, N_GEN, BETA, LR, NUM_TRAIN, SEED = 16, 8, 0.04, 1e-4, 2000, 0   # PROMPTS: set from --prompts/--shape
# the workload's own keys per shape; no speed key (sealrl's defaults)
SHAPE_SETS = {"tiny": [], "mid": [], "llama": [], "qwenvocab": [], "smollm2": ["data.max_prompt_tokens=256"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPE_SETS), default="tiny")
    p.add_argument("--model-path", type=Path, default=None, help="smollm2: the converted folder")
    p.add_argument("--prompts", type=int, default=0, help="prompts per step (0: 4 for smollm2, else 16)")
    p.add_argument("--sealrl-set", nargs="*", default=[], help="extra sealrl key=value overrides")
    p.add_argument("--side", choices=("sealrl", "trl"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-new-tokens", type=int, default=16, choices=(16, 64, 128))
    p.add_argument("--steps", type=int, default=30, help="steps per side, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps excluded from the median")
    p.add_argument("--threads", type=int, default=2, help="torch threads for both sides")
    p.add_argument("--rounds", type=int, default=2,
                   help="fresh sealrl-then-TRL runs; their timed steps are pooled (spreads load drift)")
    p.add_argument("--old-log-prob", choices=("recompute", "bypass"), default="recompute",
                   help="sealrl's algorithm.old_log_prob (recompute = its default)")
    p.add_argument("--skip", choices=("sealrl", "trl"), default=None, help="run one side only")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="samples per micro-batch on both sides (0: TRL's whole batch, sealrl's default)")
    return p.parse_args()


def matmul_gflops(repeats: int = 15) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * 1024 ** 3 / statistics.median(times[2:]) / 1e9


def num_params(model_path: Path) -> int:
    from sealrl.models.hf import load_causal_lm
    model, _ = load_causal_lm(model_path)
    return sum(p.numel() for p in model.parameters())


def step_flops(n: int, prompt_tokens: list[int], response_tokens: list[float]) -> float:
    """Useful FLOPs of one step (the formula of the module docstring); one list entry per sample."""
    tokens = sum(prompt_tokens) / N_GEN + sum(response_tokens)   # each group's prompt once
    return (2 + 2 + 6) * n * tokens


# ---- sealrl -------------------------------------------------------------------------------

def micro_sets(args) -> list[str]:
    return [f"actor.micro_batch_size={args.micro_batch}"] if args.micro_batch else []


def run_sealrl(args, workdir: Path, name: str) -> dict:
    from sealrl.config import build_config
    from sealrl.experience.store import read_iteration
    from sealrl.obs.metrics import read_metrics
    from sealrl.trainer.driver import train
    cfg = build_config(None, [
        f"model.path={args.model}", f"run.output_dir={workdir}", f"run.name={name}",
        f"run.iterations={args.steps}",
        "run.loggers=", f"run.threads={args.threads}", f"run.seed={SEED}", "eval.num=16",
        "data.task=arith", f"data.num_train={NUM_TRAIN}", f"data.prompts_per_iter={PROMPTS}",
        f"rollout.n={N_GEN}", "rollout.temperature=1.0", f"rollout.max_new_tokens={args.max_new_tokens}",
        "algorithm.name=grpo", f"algorithm.kl_coef={BETA}", "algorithm.kl_in=loss", "algorithm.kl_estimator=k3",
        f"algorithm.old_log_prob={args.old_log_prob}",
        f"actor.lr={LR}", "actor.lr_schedule=constant", "actor.loss=clip", "actor.loss_agg=token-mean",
        "actor.clip_low=0.2", "actor.clip_high=0.2", "actor.grad_clip=1.0",
        *SHAPE_SETS[args.shape], *micro_sets(args), *args.sealrl_set,
    ])
    train(cfg)
    run = workdir / name
    rows = read_metrics(run)[args.warmup:]
    times = [r["time/iteration_s"] for r in rows]
    stages = {k: [r[k] for r in rows] for k in rows[0] if k.startswith("time/") and k.endswith("_s")
              and k not in ("time/iteration_s", "time/train_wall_s")}
    prompt_tokens, response_tokens = [], []
    for r in rows:
        batch = read_iteration(run / "experience" / f"iter_{r['iteration']:06d}.parquet")
        prompt_tokens.append([len(s.prompt_ids) for s in batch.samples])
        response_tokens.append([len(s.response_ids) for s in batch.samples])
    return {"times": times, "stages": stages, "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens}


# ---- TRL ----------------------------------------------------------------------------------

def exact_match(completions, ground_truth, **_) -> list[float]:
    """1.0 when the answer text equals the ground truth: sealrl's ArithmeticExactMatch rule."""
    return [float(answer_text(c[0]["content"]) == str(t).strip()) for c, t in zip(completions, ground_truth)]


def run_trl(args, workdir: Path, name: str) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = EMBEDDED_TASK.train_rows(NUM_TRAIN, SEED)
    data = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"])}
                              for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompt_len = [len(tokenizer.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"]) for r in rows[:64]]

    class Clock(TrainerCallback):
        """Step time, and inside it the time of TRL's generation and of its whole experience
        preparation (generation + reward + reference forward + advantages); the rest is the update."""

        def __init__(self):
            self.times, self.lengths, self.parts, self._t0 = [], [], [], 0.0
            self._acc = {"generate": 0.0, "prepare": 0.0}

        def timed(self, fn, key):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self._acc[key] += time.perf_counter() - t0
            return wrapper

        def on_step_begin(self, *a, **k):
            self._acc = {"generate": 0.0, "prepare": 0.0}
            self._t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            step = time.perf_counter() - self._t0
            self.times.append(step)
            self.parts.append({"time/generate_s": self._acc["generate"],
                               "time/reward_reference_advantage_s": self._acc["prepare"] - self._acc["generate"],
                               "time/update_s": step - self._acc["prepare"]})

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    micro = args.micro_batch or PROMPTS * N_GEN   # one optimizer step per batch either way
    config = GRPOConfig(
        output_dir=str(workdir / name), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=PROMPTS * N_GEN // micro, num_generations=N_GEN,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=BETA,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=1.0, loss_type="dapo", epsilon=0.2, num_iterations=1, max_steps=args.steps,
        logging_steps=1, save_strategy="no", report_to="none", seed=SEED, dataloader_num_workers=0,
        disable_tqdm=True, log_completions=False)
    clock = Clock()
    trainer = GRPOTrainer(model=str(args.model), reward_funcs=exact_match, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)   # no per-step log dicts on stdout
    # Instance attributes shadow the methods TRL calls on itself (timing only; TRL 1.16 names).
    trainer._generate = clock.timed(trainer._generate, "generate")
    trainer._generate_and_score_completions = clock.timed(trainer._generate_and_score_completions, "prepare")
    trainer.train()
    prompt_mean = statistics.mean(prompt_len)   # the embedded prompts all have one length
    times = clock.times[args.warmup:]
    lengths = clock.lengths[args.warmup:len(clock.times)]
    parts = clock.parts[args.warmup:]
    return {"times": times, "stages": {k: [p[k] for p in parts] for k in parts[0]},
            "prompt_tokens": [[prompt_mean] * PROMPTS * N_GEN for _ in lengths],
            "response_tokens": [[m] * PROMPTS * N_GEN for m in lengths]}


# ---- report -------------------------------------------------------------------------------

def pooled(results: list[dict]) -> dict:
    out = {k: [x for r in results for x in r[k]] for k in ("times", "prompt_tokens", "response_tokens")}
    if "stages" in results[0]:
        out["stages"] = {k: statistics.median(x for r in results for x in r["stages"][k])
                         for k in results[0]["stages"]}
    return out


def summarise(result: dict, n: int, peak: float) -> dict:
    med = statistics.median(result["times"])
    flops = statistics.mean(step_flops(n, p, r)
                            for p, r in zip(result["prompt_tokens"], result["response_tokens"]))
    out = {"median_step_s": round(med, 4), "steps_timed": len(result["times"]),
           "completions_per_s": round(PROMPTS * N_GEN / med, 1),
           "mean_prompt_tokens": round(statistics.mean(x for r in result["prompt_tokens"] for x in r), 2),
           "mean_response_tokens": round(statistics.mean(x for r in result["response_tokens"] for x in r), 2),
           "useful_gflops": round(flops / med / 1e9, 2), "frac_of_matmul": round(flops / med / 1e9 / peak, 3)}
    if "stages" in result:
        out["stages_median_s"] = {k: round(v, 4) for k, v in result["stages"].items()}
    return out


def run_side(args) -> None:
    """Child process: one side, one round; prints its results and its own peak RSS as JSON."""
    torch.set_num_threads(args.threads)
    fn = run_sealrl if args.side == "sealrl" else run_trl
    out = fn(args, args.workdir, f"{args.side}{args.rounds}")
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["openmp"] = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    print(json.dumps(out))


def spawn_side(args, side: str, model: Path, workdir: Path, i: int) -> dict:
    """One side in a fresh subprocess (its own peak RSS), the same arguments."""
    cmd = [sys.executable, __file__, "--side", side, "--model", str(model), "--workdir", str(workdir),
           "--shape", args.shape, "--prompts", str(PROMPTS), "--max-new-tokens", str(args.max_new_tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--rounds", str(i), "--old-log-prob", args.old_log_prob, "--micro-batch", str(args.micro_batch),
           "--sealrl-set", *args.sealrl_set]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{side} subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    global PROMPTS
    args = parse_args()
    PROMPTS = args.prompts or (4 if args.shape == "smollm2" else 16)
    if args.micro_batch and (PROMPTS * N_GEN % args.micro_batch or args.micro_batch % N_GEN):
        raise SystemExit(f"--micro-batch {args.micro_batch}: must divide the batch ({PROMPTS} x {N_GEN}) "
                         f"and be a multiple of the group size {N_GEN}")
    if args.side:
        return run_side(args)
    from shapes import model_folder
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.shape, Path(tmp), args.model_path)
        if model is None:
            print(json.dumps({"shape": args.shape, "skipped": "no converted SmolLM2-135M-Instruct folder at "
                              f"{args.model_path or 'models/smollm2-135m-instruct'} (scripts/convert_smollm2.py)"}))
            return
        peak = matmul_gflops()
        n = num_params(model)
        report = {"shape": args.shape, "prompts": PROMPTS, "max_new_tokens": args.max_new_tokens, "steps": args.steps,
                  "warmup": args.warmup, "rounds": args.rounds, "sealrl_old_log_prob": args.old_log_prob,
                  "micro_batch": args.micro_batch, "sealrl_set": SHAPE_SETS[args.shape] + args.sealrl_set,
                  "threads": args.threads, "params": n, "torch": torch.__version__}
        runs: dict[str, list[dict]] = {"sealrl": [], "trl": []}
        for i in range(args.rounds):
            for side in ("sealrl", "trl"):
                if args.skip != side:
                    runs[side].append(spawn_side(args, side, model, Path(tmp), i))
        peak = max(peak, matmul_gflops())   # again after: the higher of the two (less disturbed) one
    report["matmul_gflops"] = round(peak, 1)
    for side in ("sealrl", "trl"):
        if runs[side]:
            report[side] = summarise(pooled(runs[side]), n, peak)
            report[side]["peak_rss_mib"] = round(max(r["peak_rss_mib"] for r in runs[side]), 1)
            report[side]["openmp"] = runs[side][0]["openmp"]   # the side's OpenMP wait ({}: GNU OpenMP's default)
    if runs["trl"]:
        import trl
        report["trl_version"] = trl.__version__
    if "sealrl" in report and "trl" in report:
        report["ratio"] = round(report["trl"]["median_step_s"] / report["sealrl"]["median_step_s"], 2)
        report["frac_of_matmul"] = {s: report[s]["frac_of_matmul"] for s in ("sealrl", "trl")}
        report["peak_rss_mib"] = {s: report[s]["peak_rss_mib"] for s in ("sealrl", "trl")}
    report["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
