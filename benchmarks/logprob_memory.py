"""Peak memory and time of log-probs + entropy with gradients: full fp32 logits vs chunked.

The LM-head part of one teacher-forced micro-batch at the `--shape mid` benchmark's size
(M = 128 samples x 64 response tokens = 8192 predicted tokens, hidden 384, vocabulary 16,384):
forward of log-probs and entropy, then the backward of a weighted sum of both, reaching the
hidden states and the head weight. Each variant runs in its own subprocess so that its peak
RSS (ru_maxrss) is its own; `peak_rss_mib` minus `base_rss_mib` (after the inputs were built)
is what the computation added.

    .venv/bin/python benchmarks/logprob_memory.py [--tokens 8192 --hidden 384 --vocab 16384 --chunk 1024]

The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def one(args) -> dict:
    import torch

    from sealrl.models.chunked import chunked_log_probs
    from sealrl.models.logprobs import token_entropy, token_log_probs
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.05).requires_grad_(True)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    if args.variant == "full":
        logits = hidden @ weight.t()
        lp, ent = token_log_probs(logits, tokens), token_entropy(logits)
    else:
        lp, ent = chunked_log_probs(hidden, weight, tokens, 1.0, args.chunk, with_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": args.variant, "base_rss_mib": round(base, 1), "peak_rss_mib": round(peak, 1),
            "added_mib": round(peak - base, 1), "wall_s": round(wall, 3),
            "lp_sum": float(lp.sum()), "grad_w_norm": float(weight.grad.norm())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", choices=("full", "chunked"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    report = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "chunk": args.chunk,
              "full_logits_mib": round(args.tokens * args.vocab * 4 / 2 ** 20, 1)}
    for variant in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant] + [f"--{k}={getattr(args, k)}" for k in
                                                                 ("tokens", "hidden", "vocab", "chunk", "threads")]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        report[variant] = json.loads(out)
    report["lp_sum_diff"] = abs(report["full"]["lp_sum"] - report["chunked"]["lp_sum"])
    report["memory_ratio"] = round(report["full"]["added_mib"] / max(1.0, report["chunked"]["added_mib"]), 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
