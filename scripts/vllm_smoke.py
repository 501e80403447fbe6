"""Smoke check of a vLLM install (`make install-vllm`): vLLM loads the embedded model, samples
from token-id prompts, and its log-probs of the sampled tokens equal a teacher-forced HF pass.

    .venv-vllm/bin/python scripts/vllm_smoke.py

logprobs_mode="processed_logprobs" gives log_softmax(logits / T) of the sampled token after
vLLM's top-k/top-p filter: with neither filter on, exactly the space sealrl's records declare
(RolloutSample.rollout_log_probs). "raw_logprobs" is log_softmax(logits), without the
temperature, so it equals that space only at T = 1. Prints the largest difference at T = 1
and T = 0.7; exits 1 when it exceeds 1e-5.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")           # GiB of KV cache on CPU
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # share the cores, do not pin them

import torch  # noqa: E402

from sealrl.config.sections import EMBEDDED_MODEL  # noqa: E402


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    started = time.perf_counter()
    llm = LLM(model=EMBEDDED_MODEL, dtype="float32", enforce_eager=True, logprobs_mode="processed_logprobs",
              max_model_len=128, generation_config="vllm")
    print(f"engine up in {time.perf_counter() - started:.1f} s")
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL, dtype=torch.float32).eval()
    ids = tok("12+34=")["input_ids"]
    worst = 0.0
    for temperature in (1.0, 0.7):
        params = [SamplingParams(temperature=temperature, max_tokens=6, seed=s, logprobs=0) for s in range(4)]
        for out in llm.generate([TokensPrompt(prompt_token_ids=ids)] * 4, params, use_tqdm=False):
            c = out.outputs[0]
            got = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            with torch.no_grad():
                logits = hf(torch.tensor([ids + list(c.token_ids)])).logits[0, len(ids) - 1:-1] / temperature
            want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            diff = float((got - want).abs().max())
            worst = max(worst, diff)
            print(f"T={temperature} tokens {list(c.token_ids)} ({c.finish_reason}) max |vllm - hf| {diff:.2e}")
    print(f"largest log-prob difference {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
