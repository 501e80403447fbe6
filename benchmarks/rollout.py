"""Rollout throughput: sealrl's RolloutEngine against Hugging Face `generate` (and vLLM), one machine.

Both sample the same prompts (16 two-digit additions by default, each n=8 times) from the same
weights with the same settings: temperature 1.0, no top-k/top-p, up to 32 new tokens, KV
cache on. Tokens are counted the same way for both: every generated response token up to and
including the first eos, nothing after it. Repeats alternate between the two engines so that
load from other processes on a shared machine hits both alike; the medians are compared.

Run:
    .venv/bin/python benchmarks/rollout.py                      # embedded model
    .venv/bin/python benchmarks/rollout.py --model PATH --device cuda
    .venv/bin/python benchmarks/rollout.py --shape smollm2 --prompts 4 --max-new-tokens 64
    .venv/bin/python benchmarks/rollout.py --shape mid --max-new-tokens 64
    .venv-vllm/bin/python benchmarks/rollout.py --backend vllm     # vLLM beside both (make install-vllm)

With --backend vllm, sealrl's vLLM backend (rollout/vllm_engine.py: one vLLM request per
candidate, its own seed, log-probs returned) samples the same requests from the same weights
and joins the alternation; its start-up (engine process, dummy weights, the first load) is not
timed, its first generate is the warm-up like the others'.

The model is PATH if given, else the --shape folder of benchmarks/shapes.py (mid: the random
Qwen2 layout of vs_trl.py --shape mid; smollm2: the converted SmolLM2-135M-Instruct folder),
else the warm-start checkpoint sealrl/assets/arith-tiny if present, else the randomly
initialised build_tiny_model(0). Prompts go through the tokenizer's chat template when it has
one (as vs_trl.py renders them), else they are the bare "07+45=" text. The last line printed
is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Idle OpenMP workers must sleep, not spin, or a busy second core slows every op many-fold;
# read when torch loads, so it is set before the import (for both engines alike).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sealrl.experience.records import SamplingContract  # noqa: E402
from sealrl.experience.wire import GenerationRequest  # noqa: E402
from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash  # noqa: E402
from sealrl.models.tiny import build_tiny_model  # noqa: E402
from sealrl.rollout import RolloutEngine  # noqa: E402
from sealrl.sync.manifest import build_manifest  # noqa: E402

WARM_START = Path(__file__).resolve().parent.parent / "sealrl" / "assets" / "arith-tiny"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="local HF causal-LM folder")
    p.add_argument("--shape", choices=("tiny", "mid", "smollm2"), default=None,
                   help="a model of benchmarks/shapes.py (when --model is not given)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8, help="candidates per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch default")
    p.add_argument("--backend", choices=("native", "vllm"), default="native",
                   help="vllm: also time sealrl's vLLM backend (needs vLLM: make install-vllm)")
    return p.parse_args()


def load_model(path: Path | None, device: str):
    if path is None and WARM_START.is_dir():
        path = WARM_START
    if path is not None:
        model, tokenizer = load_causal_lm(path, device=device)
        return model, tokenizer, str(path)
    model, tokenizer = build_tiny_model(0)
    return model.to(device), tokenizer, "build_tiny_model(0)"


def addition_prompts(tokenizer, num: int, seed: int = 0) -> list[list[int]]:
    """'07+45=' style prompts, the embedded arithmetic task's format, in the chat template when
    the tokenizer has one (rendered as sealrl.data.dataset renders a chat prompt)."""
    rng = random.Random(seed)
    texts = [f"{rng.randrange(100):02d}+{rng.randrange(100):02d}=" for _ in range(num)]
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def count_until_eos(rows: list[list[int]], eos_ids: set[int]) -> int:
    total = 0
    for row in rows:
        stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
        total += len(row) if stop is None else stop + 1
    return total


def run_sealrl(engine, version, prompts, args, repeat: int) -> int:
    contract = SamplingContract(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    requests = [GenerationRequest(f"bench/{repeat}/{i}", tuple(p), seed=repeat * 100_003 + i,
                                  candidates=tuple(range(args.n))) for i, p in enumerate(prompts)]
    samples = engine.generate(requests, contract, version)
    return sum(len(s.response_ids) for s in samples)


def run_hf(model, tokenizer, prompts, args, repeat: int, eos_ids: set[int]) -> int:
    rows = [p for p in prompts for _ in range(args.n)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    torch.manual_seed(repeat)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=args.temperature, top_k=0, top_p=1.0,
                             max_new_tokens=args.max_new_tokens, use_cache=True,
                             pad_token_id=pad, eos_token_id=sorted(eos_ids))
    return count_until_eos(out[:, width:].tolist(), eos_ids)


def timed(fn, device: str) -> tuple[float, int]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if path is None and args.shape is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from shapes import model_folder
        path = model_folder(args.shape, Path(tempfile.mkdtemp(prefix="sealrl-rollout-bench-")))
        if path is None:
            raise SystemExit("rollout.py --shape smollm2: no converted folder at models/smollm2-135m-instruct "
                             "(make smollm2)")
    model, tokenizer, source = load_model(path, args.device)
    engine = RolloutEngine(model, tokenizer, device=args.device)
    manifest = build_manifest(model.state_dict(), "bench", 0, 0, tokenizer_hash(tokenizer),
                              model_config_hash(model.config))
    engine.load_weights(model.state_dict(), manifest)
    prompts = addition_prompts(tokenizer, args.prompts)
    eos_ids = set(engine.eos_ids)

    vllm = None
    if args.backend == "vllm":
        from sealrl.rollout.vllm_engine import VllmEngine
        vllm = VllmEngine(model, tokenizer)
        vllm.load_weights(model.state_dict(), manifest)

    results: dict[str, list[tuple[float, int]]] = {"sealrl": [], "hf": [], **({"vllm": []} if vllm else {})}
    for repeat in range(-1, args.repeats):  # repeat -1 is the warm-up, not recorded
        runs = {"sealrl": lambda: run_sealrl(engine, manifest.version, prompts, args, repeat),
                "hf": lambda: run_hf(model, tokenizer, prompts, args, repeat, eos_ids)}
        if vllm is not None:
            runs["vllm"] = lambda: run_sealrl(vllm, manifest.version, prompts, args, repeat)
        for name, fn in runs.items():
            seconds, tokens = timed(fn, args.device)
            if repeat >= 0:
                results[name].append((seconds, tokens))
                print(f"{name:6s} repeat {repeat}: {tokens} tokens in {seconds:.3f} s "
                      f"({tokens / seconds:,.0f} tokens/s)", flush=True)

    summary = {"model": source, "device": args.device, "threads": torch.get_num_threads(),
               "prompts": args.prompts, "n": args.n, "max_new_tokens": args.max_new_tokens,
               "temperature": args.temperature, "repeats": args.repeats,
               "backend": engine.backend_name,
               "prompt_tokens": sum(map(len, prompts)) / len(prompts),
               "load_avg_1m": round(os.getloadavg()[0], 2)}
    for name, runs in results.items():
        summary[f"{name}_tokens_per_s"] = round(statistics.median(t / s for s, t in runs), 1)
        summary[f"{name}_median_s"] = round(statistics.median(s for s, _ in runs), 4)
        summary[f"{name}_median_tokens"] = statistics.median(t for _, t in runs)
    summary["ratio"] = round(summary["sealrl_tokens_per_s"] / summary["hf_tokens_per_s"], 2)
    if vllm is not None:
        summary["vllm_vs_native"] = round(summary["vllm_tokens_per_s"] / summary["sealrl_tokens_per_s"], 2)
        vllm.close()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
