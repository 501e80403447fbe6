"""Would `torch.compile` pay for sealrl's lean teacher-forced forward? Speed and determinism.

The lean forward (sealrl/models/lean_forward.py) runs many small element-wise ops around its
matmuls; on the embedded model they are most of a training pass (docs/benchmarks.md, "Session
28"). This script compiles the same decoder stack with inductor (dynamic shapes) and measures:

- speed: forward + backward of the stack and the LM head's log-probs on the embedded model,
  eager against compiled, on batches like vs_trl.py's tiny shape (16 prompts x 8 samples, one
  prompt stored once per group), the first call (the compile) apart;
- determinism: the hidden states and every weight gradient of fixed batches, as one digest per
  batch, in fresh processes that compile the batches in different orders (each its own empty
  inductor cache). sealrl's exact resume and offline replay need a batch to give the same bits
  whatever ran before it in the process; the eager forward does.

The compiled stack is a copy of lean_hidden's layer loop on the module's own helpers, with the
attention grid as index tensors (B and L come from their shapes) and the math attention kernel
in every pass. Needs a C++ compiler (inductor's CPU backend). Not part of sealrl.

    PYTHONPATH=. .venv/bin/python benchmarks/compile_check.py --threads 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from sealrl.models import lean_forward as lf
from sealrl.models.hf import load_causal_lm
from sealrl.models.packing import pack_shared_prompts

TINY = Path(__file__).resolve().parent.parent / "sealrl" / "assets" / "arith-tiny"
# (seed, response tokens, prompts): each batch is `prompts` groups of 8 samples
ORDERS = (("1,2,4", "2,40,16", "3,7,1"), ("2,40,16", "3,7,1", "1,2,4"), ("3,7,1",))


def stack(decoder, cfg, x, cos, sin, index, src, dst):
    """lean_hidden's layers and final norm on flat states x (N, hidden); src (B, L) grid slot ->
    flat token, dst (N,) flat token -> grid slot."""
    B, L = src.shape
    eps, width, act = cfg.rms_norm_eps, (cfg.hidden_size,), ACT2FN[cfg.hidden_act]
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        h = F.rms_norm(x, width, layer.input_layernorm.weight, eps)
        qkv = lf._fused(h, (attn.q_proj, attn.k_proj, attn.v_proj)).index_select(0, src.flatten())
        qkv = qkv.view(B, L, H + 2 * Hkv, attn.head_dim)
        qk = lf._rotate(qkv[:, :, :H + Hkv], cos, sin)
        q, k, v = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), qkv[:, :, H + Hkv:].transpose(1, 2)
        out = torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.0, True, scale=attn.scaling,
                                                                 enable_gqa=H != Hkv)[0]
        x = lf._residual(x, out.transpose(1, 2).flatten(0, 1).flatten(1).index_select(0, dst), attn.o_proj)
        gate, up = lf._fused(F.rms_norm(x, width, layer.post_attention_layernorm.weight, eps),
                             (mlp.gate_proj, mlp.up_proj)).chunk(2, dim=-1)
        x = lf._residual(x, act(gate) * up, mlp.down_proj)
    return F.rms_norm(x.index_select(0, index), width, decoder.norm.weight, eps)


def batch(seed: int, response: int, prompts: int) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    ps, rs = [], []
    for k in range(prompts):
        p = torch.randint(3, 101, (9 + k % 3,), generator=gen).tolist()
        for c in range(8):
            ps.append(p)
            rs.append(torch.randint(3, 101, (response + c % 3,), generator=gen).tolist())
    return ps, rs


def step(model, fn, prompts, responses) -> torch.Tensor:
    """Forward (hidden states, then log-probs of the responses) and backward; the hidden states."""
    packed = pack_shared_prompts(prompts, responses, "cpu")
    ids, index = packed.input_ids[0], packed.predicting_index(0)
    decoder = lf.decoder_of(model)
    grid = lf._SharedGrid(packed.rows, len(ids), ids.device)
    x = decoder.embed_tokens(ids)
    cos, sin = decoder.rotary_emb(x, torch.arange(grid.L)[None])
    hidden = fn(decoder, model.config, x, cos[0, :, None], sin[0, :, None], index,
                grid.src.view(grid.B, grid.L), grid.dst)
    targets = torch.tensor([t for r in responses for t in r])
    model.lm_head(hidden).log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    return hidden


def digests(model, fn, specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        model.zero_grad()
        hidden = step(model, fn, *batch(*map(int, spec.split(","))))
        grads = b"".join(p.grad.numpy().tobytes() for p in model.parameters() if p.grad is not None)
        out[spec] = hashlib.sha256(hidden.detach().numpy().tobytes() + grads).hexdigest()[:16]
    return out


def speed(model, fn, repeats: int) -> dict:
    t0 = time.perf_counter()
    step(model, fn, *batch(0, 4, 16))
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats):
        b = batch(i + 1, 2 + i % 5, 16)   # 2-6 response tokens: new lengths every call
        t0 = time.perf_counter()
        step(model, fn, *b)
        times.append(time.perf_counter() - t0)
    return {"first_call_s": round(first, 2), "median_ms": round(statistics.median(times[2:]) * 1e3, 1)}


def child(args) -> None:
    torch.set_num_threads(args.threads)
    model = load_causal_lm(TINY)[0].train()
    fn = torch.compile(stack, dynamic=True) if args.mode == "compiled" else stack
    out = digests(model, fn, args.specs) if args.specs else speed(model, fn, args.repeats)
    print(json.dumps(out))


def spawn(args, mode: str, specs=()) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        cmd = [sys.executable, __file__, "--child", mode, "--threads", str(args.threads),
               "--repeats", str(args.repeats), *(["--specs", *specs] if specs else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{mode} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20, help="timed calls per side (the first two not counted)")
    p.add_argument("--child", dest="mode", choices=("eager", "compiled"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--specs", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode:
        return child(args)
    report = {"torch": torch.__version__, "threads": args.threads}
    for mode in ("eager", "compiled"):
        report[f"speed_{mode}"] = spawn(args, mode)   # each with an empty inductor cache
        runs = [spawn(args, mode, order) for order in ORDERS]
        report[f"digests_{mode}"] = runs
        report[f"deterministic_{mode}"] = all(len({r[s] for r in runs if s in r}) == 1 for s in ORDERS[0])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
