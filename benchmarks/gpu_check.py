"""GPU checks of issue 14, in one prepared run (no GPU was lent when they were written; run
this where one is): the GPU-marked tests, then on CUDA in fp32 and bf16 the chunked and packed
log-probs against the full-logits padded path, the peak CUDA memory of both at the mid
shape's LM head, and short trainings with every role on cuda (GRPO with a reference in fp32,
twice: the same weights hash, and in bf16; PPO in fp32: the critic), each audited from its
records; where vLLM is installed, the vLLM backend's checks (gpu_vllm.py, issue 28). Prints
one JSON line; exits non-zero when a check fails.

    .venv/bin/python benchmarks/gpu_check.py            (a few minutes on one GPU)
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml


def head_memory(dtype: torch.dtype, chunk: int) -> dict:
    from sealrl.models.chunked import chunked_log_probs
    from sealrl.models.logprobs import token_entropy, token_log_probs
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(8192, 384, device="cuda", generator=g).requires_grad_(True)
    w = (torch.randn(16384, 384, device="cuda", generator=g) * 0.05).requires_grad_(True)
    tok = torch.randint(0, 16384, (8192,), device="cuda", generator=g)
    out = {}
    for name in ("full", "chunked"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            if name == "full":
                logits = h @ w.t()
                lp, ent = token_log_probs(logits, tok), token_entropy(logits)
            else:
                lp, ent = chunked_log_probs(h, w, tok, 1.0, chunk, with_entropy=True)
        (lp.sum() + 0.01 * ent.sum()).backward()
        torch.cuda.synchronize()
        out[name] = {"peak_mib": round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1),
                     "lp_sum": float(lp.sum())}
        h.grad = w.grad = None
    return out


def model_parity() -> dict:
    from sealrl.models.logprobs import response_log_probs
    from sealrl.models.packing import packed_log_probs, padded_chunked_log_probs
    from sealrl.models.synthetic import build_mid
    model = build_mid(seed=0)[0].cuda()
    prompts = [[11, 12, 14, 8, 6, 18], [5, 9], [20] * 30]
    responses = [list(range(100, 164)), [7], list(range(300, 340))]
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            ref, _, mask = response_log_probs(model, prompts, responses)
            packed, _, _ = packed_log_probs(model, prompts, responses, chunk=256)
            chunked, _, _ = padded_chunked_log_probs(model, prompts, responses, 1.0, 0, False, 256)
        out[name] = {"packed_gap": float((packed - ref).abs().max()), "chunked_gap": float((chunked - ref).abs().max())}
    return out


TRAIN = ["run.iterations=3", "run.loggers=", "run.checkpoint_every=0", "data.num_train=64",
         "eval.num=16", "data.prompts_per_iter=8", "rollout.n=4", "rollout.max_new_tokens=8", "run.seed=1",
         "algorithm.kl_coef=0.05", "actor.device=cuda", "reference.device=cuda",
         "rollout.device=cuda"]


def train_on_cuda(name: str, *extra: str, example: str | None = None) -> dict:
    """A short run of the embedded model with every role on cuda: its final weights hash, the
    first and last iteration's reward and loss, its wall time and whether its audit passes."""
    from sealrl.audit import audit_run
    from sealrl.config import build_config
    from sealrl.trainer.driver import train
    out = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
    started = time.perf_counter()
    raw = yaml.safe_load(Path(example).read_text()) if example else None
    summary = train(build_config(raw, [*TRAIN, *extra, f"run.output_dir={out}", "run.name=r"]))
    rows = [json.loads(x) for x in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "actor/pg_loss" in r]
    report = audit_run(out / "r")
    return {"weights_hash": summary["weights_hash"][:16], "iterations": summary["iterations"],
            "wall_s": round(time.perf_counter() - started, 1),
            "reward_first": rows[0]["reward/mean"], "reward_last": rows[-1]["reward/mean"],
            "pg_loss_last": rows[-1]["actor/pg_loss"], "audit_ok": report.ok,
            "audit_violations": [str(v) for v in report.violations[:3]]}


def trainings() -> tuple[dict, bool]:
    """The runs (a crash is reported as that run's error, the others still run) and whether
    all completed, audited clean, and the fp32 run repeated to the same weights. Beyond the
    plain GRPO and PPO runs: LoRA (fp32 and with a bf16 rollout), async with the generation in
    its own process (CUDA in a spawned child), continuous batching, and tool episodes."""
    runs = {}
    bf16 = ("actor.dtype=bf16", "rollout.dtype=bf16")
    lora = ("actor.lora.rank=8", "actor.lora.alpha=16", "actor.lora.target_modules=all-linear")
    tools = Path(__file__).resolve().parents[1] / "examples" / "arith_tools.yaml"
    for name, extra in (("grpo_fp32", ()), ("grpo_fp32_again", ()), ("grpo_bf16", bf16),
                        ("ppo_fp32", ("algorithm.name=ppo",)), ("grpo_lora", lora),
                        ("grpo_lora_bf16_rollout", (*lora, "rollout.dtype=bf16")),
                        ("grpo_async_process", ("rollout.max_staleness=1", "rollout.lane=process",
                                                "algorithm.correction=token_is")),
                        ("grpo_continuous", ("rollout.max_rows=8",)),
                        ("grpo_tools", ("rollout.max_new_tokens=24", "run.max_wall_s=0"))):
        try:
            runs[name] = train_on_cuda(name, *extra, example=str(tools) if name == "grpo_tools" else None)
        except Exception as e:  # noqa: BLE001 - the report names it; the other runs still tell
            runs[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    ok = all(r.get("audit_ok") and r["iterations"] == 3 for r in runs.values())
    runs["fp32_repeatable"] = ok and runs["grpo_fp32"]["weights_hash"] == runs["grpo_fp32_again"]["weights_hash"]
    return runs, ok and runs["fp32_repeatable"]


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device visible"}))
        return 0
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"], capture_output=True, text=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"device": torch.cuda.get_device_name(), "gpu_tests_rc": tests.returncode,
              "gpu_tests_tail": tests.stdout.strip().splitlines()[-1:],
              "head_fp32": head_memory(torch.float32, 1024), "head_bf16": head_memory(torch.bfloat16, 1024),
              "parity": model_parity()}
    report["train"], trained = trainings()
    if importlib.util.find_spec("vllm") is not None:   # the CUDA build of vLLM (pip install 'sealrl[vllm]')
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_vllm import vllm_report
        report["vllm"], vllm_ok = vllm_report()
        trained = trained and vllm_ok
    ok = (tests.returncode == 0 and report["parity"]["fp32"]["packed_gap"] <= 1e-4
          and report["parity"]["fp32"]["chunked_gap"] <= 1e-4
          and report["head_fp32"]["chunked"]["peak_mib"] < report["head_fp32"]["full"]["peak_mib"]
          and trained)
    report["ok"] = ok
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
