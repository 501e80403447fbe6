"""Continuous batching (what runs use with rollout.max_rows > 0) against fixed waves and the unbounded batch.

One generate call of `--prompts` requests x `--n` candidates, at most `--max-rows` rows decoding
at once: in waves (each wave runs as long as its longest response) or continuously (waiting
requests admitted into finished rows, rollout/scheduler.py); the unbounded batch (max_rows=0,
the default, every row at once) is the reference. Response lengths vary: a set of frequent
tokens of the model are stop tokens (`--stops`), so rows stop anywhere from 1 to
`--max-new-tokens`. Checked: every mode samples the reference's ids (log-probs within 1e-5).
Repeats alternate the modes; medians of wall seconds and response tokens per second.

Run:
    .venv/bin/python benchmarks/continuous.py                     # tiny model, 32 x 4 rows, 32 at once
    .venv/bin/python benchmarks/continuous.py --shape mid --device cuda --prompts 64 --max-rows 64

The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sealrl.experience.records import SamplingContract  # noqa: E402
from sealrl.experience.wire import GenerationRequest  # noqa: E402
from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash  # noqa: E402
from sealrl.models.tiny import build_tiny_model  # noqa: E402
from sealrl.rollout import RolloutEngine  # noqa: E402
from sealrl.sync.manifest import build_manifest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import model_folder  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="", help="a model of benchmarks/shapes.py (default: the tiny model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-rows", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--stops", type=int, default=6, help="most frequent sampled tokens used as stop tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = load_causal_lm(model_folder(args.shape, Path(tmp)), device=args.device) if args.shape \
            else build_tiny_model(0)   # untrained: its stop tokens end rows anywhere
        engine = RolloutEngine(model, tok, device=args.device)
        manifest = build_manifest(model.state_dict(), "bench", 0, 0, tokenizer_hash(tok),
                                  model_config_hash(model.config))
        engine.load_weights(model.state_dict(), manifest)
        version = manifest.version
    prompts = [f"{a:02d}+{b:02d}=" for a, b in zip(range(7, 99, 3), range(45, 0, -1))][:args.prompts]
    reqs = [GenerationRequest(f"b/0/{i}", tuple(tok(p, add_special_tokens=False).input_ids), seed=1000 + i,
                              candidates=tuple(range(args.n))) for i, p in enumerate(prompts)]
    probe = engine.generate(reqs, SamplingContract(max_new_tokens=args.max_new_tokens), version)
    common = Counter(t for s in probe for t in s.response_ids).most_common(args.stops)
    contract = SamplingContract(max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(t for t, _ in common))
    modes = {"unbounded": (0, False), "waves": (args.max_rows, False), "continuous": (args.max_rows, True)}
    times, ref, agree = {m: [] for m in modes}, None, {}
    for _ in range(args.repeats):
        for mode, (rows, cont) in modes.items():
            engine.max_rows, engine.continuous = rows, cont
            t0 = time.perf_counter()
            out = engine.generate(reqs, contract, version)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[mode].append(time.perf_counter() - t0)
            ref = out if ref is None else ref
            agree[mode] = (all(a.response_ids == b.response_ids for a, b in zip(out, ref)),
                           max(abs(x - y) for a, b in zip(out, ref) for x, y in zip(a.rollout_log_probs,
                                                                                    b.rollout_log_probs)))
    tokens = sum(len(s.response_ids) for s in ref)
    lengths = sorted(len(s.response_ids) for s in ref)
    result = {"rows": len(ref), "max_rows": args.max_rows, "response_tokens": tokens,
              "length_p10_p50_p90": [lengths[len(lengths) // 10], lengths[len(lengths) // 2],
                                     lengths[9 * len(lengths) // 10]],
              **{m: {"median_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t),
                     "same_ids": agree[m][0], "max_logprob_diff": agree[m][1]} for m, t in times.items()}}
    result["continuous_over_waves"] = result["continuous"]["tokens_per_s"] / result["waves"]["tokens_per_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
