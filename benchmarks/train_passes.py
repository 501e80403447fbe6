"""Per-pass times of sealrl's teacher-forced passes at the `mid` shape, on the vs_trl --shape mid
batch (16 prompts x 8, 64-token responses, prompts of 5-7 tokens), or with --shape tiny on the
embedded model (sealrl/assets/arith-tiny; 16 x 8, 4-token responses as its warm start gives,
full logits as vs_trl runs it): the fused old-log-prob forward
with gradients (`Actor.compute_old_log_probs`), the update (backward + AdamW; `Actor.update`), and
the reference pass (`Reference.compute`), through the roles' own code. Variants (lists of actor
config overrides) run in one process, alternating, so machine load drifts over all alike; each
pass's FLOP utilisation is given against a matmul throughput measured in the same process.
Freed memory stays in malloc's heap, as in a run (`run.hold_freed_memory`, trainer/memory.py);
--trim leaves malloc as it is, so each pass faults its fresh buffers in again (before session 29
this script always did: at mid its forward with gradients then took 1.5x a run's, session 29).

    PYTHONPATH=. .venv/bin/python benchmarks/train_passes.py --threads 1 --repeats 3 \
        --variant fast: --variant exact:run.exact=true
    PYTHONPATH=. .venv/bin/python benchmarks/train_passes.py --shape tiny --repeats 9 \
        --variant fast: --variant memory:actor.logit_chunk_tokens=1024
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from sealrl.config import build_config  # noqa: E402
from sealrl.experience import (  # noqa: E402
    ExperienceBatch,
    PolicyVersion,
    Role,
    SampleMeta,
    SamplingContract,
    StopReason,
    group_id,
    pad_token_rows,
    sample_id,
)
from sealrl.models.hf import load_causal_lm  # noqa: E402
from sealrl.models.synthetic import build_mid  # noqa: E402
from sealrl.roles import common  # noqa: E402
from sealrl.roles.actor import Actor  # noqa: E402
from sealrl.roles.reference import Reference  # noqa: E402
from sealrl.trainer.memory import hold_freed_memory  # noqa: E402

V0 = PolicyVersion("run", 0, 0, "w0", "t0", "c0")
TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sealrl", "assets", "arith-tiny")
# per shape: the model, and extra keys (none: both run sealrl's defaults, as vs_trl.py does)
SHAPES = {"mid": (lambda: build_mid(0)[0], []),
          "tiny": (lambda: load_causal_lm(TINY)[0], [])}


def make_batch(prompts: int, n: int, response: int, vocab: int, seed: int = 0) -> ExperienceBatch:
    gen = torch.Generator().manual_seed(seed)
    metas = []
    for k in range(prompts):
        g = group_id("run", 0, f"p{k}")
        prompt = tuple(torch.randint(3, vocab, (5 + k % 3,), generator=gen).tolist())
        for c in range(n):
            resp = tuple(torch.randint(3, vocab, (response,), generator=gen).tolist())
            metas.append(SampleMeta(sample_id(g, c), g, f"p{k}", prompt, resp, StopReason.LENGTH, V0.id, seed=c))
    batch = ExperienceBatch("run", 0, metas, SamplingContract(max_new_tokens=response, n=n), [V0])
    w = batch.num_response_tokens
    mask = pad_token_rows([[1] * len(m.response_ids) for m in metas], w, torch.bool)
    batch.put("response_mask", mask, Role.ROLLOUT, V0.id)
    batch.put("rollout_log_probs", torch.zeros(len(metas), w), Role.ROLLOUT, V0.id)   # (the mismatch metric's)
    adv = torch.randn(len(metas), 1, generator=gen).expand(-1, w).contiguous()
    batch.put("advantages", adv, Role.DRIVER, "test")
    return batch


def matmul_gflops(clock=time.perf_counter, repeats: int = 15) -> float:
    """fp32 1024^3 matmul throughput, timed by `clock` (wall time, or this process's CPU time)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    times = []
    for _ in range(repeats + 2):
        t0 = clock()
        torch.mm(a, b)
        times.append(clock() - t0)
    return 2 * 1024 ** 3 / statistics.median(times[2:]) / 1e9


def timed(out: dict, key: str, fn):
    """Run fn; wall time under `key`, this process's CPU time under `key`_cpu (on a machine shared
    with other processes the CPU time is the steadier figure: it leaves out time-slicing)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    out[key], out[key + "_cpu"] = time.perf_counter() - t0, time.process_time() - c0
    return result


def one_round(shape: str, model_state, variant: list[str], batch_args, seed: int) -> dict:
    build, keys = SHAPES[shape]
    cfg = build_config(None, ["actor.micro_batch_size=128", "actor.lr=1e-4", "actor.lr_schedule=constant",
                              *keys, "algorithm.kl_coef=0.04", "algorithm.kl_in=loss", *variant])
    model = build()
    model.load_state_dict(model_state)
    batch = make_batch(*batch_args)
    tf = common.teacher_forcing(cfg.actor, model, cfg.run.exact, batch_args[1])   # the run's path (setup.passes)
    ref = Reference(model, V0, 1.0, 0, 128, tf=tf)
    actor = Actor(model, cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, batch.num_response_tokens,
                  tf=tf, exact=cfg.run.exact)
    out = {}
    timed(out, "reference", lambda: ref.compute(batch))
    timed(out, "old_log_prob", lambda: actor.compute_old_log_probs(batch, V0))
    snap = timed(out, "snapshot", actor.snapshot)
    metrics = timed(out, "update", lambda: actor.update(batch, V0, 0, seed, kl_coef=0.04))
    del snap
    out["pg_loss"] = metrics["actor/pg_loss"]
    out["grad_norm"] = metrics["actor/grad_norm"]
    out["weights_sum"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:key=value,key=value (config overrides); default fast:")
    p.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    p.add_argument("--response", type=int, default=0, help="response tokens (0: 64 at mid, 4 at tiny)")
    p.add_argument("--trim", action="store_true", help="malloc as it is: freed memory goes back to the OS "
                   "(run.hold_freed_memory=false); default: held, as a run holds it")
    args = p.parse_args()
    held = False if args.trim else hold_freed_memory()
    response = args.response or (64 if args.shape == "mid" else 4)
    torch.set_num_threads(args.threads)
    variants = [(name, [x for x in keys.split(",") if x])
                for name, keys in (v.split(":", 1) for v in args.variant or ["fast:"])]
    model = SHAPES[args.shape][0]()
    n_params = sum(q.numel() for q in model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batch_args = (16, 8, response, model.config.vocab_size)
    b = make_batch(*batch_args)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in b.samples)
    flops = {"reference": 2 * n_params * tokens, "old_log_prob": 2 * n_params * tokens,
             "update": 4 * n_params * tokens}
    results = {name: [] for name, _ in variants}
    gf, gc = [matmul_gflops()], [matmul_gflops(time.process_time)]
    for r in range(args.repeats):
        for name, over in variants:
            results[name].append(one_round(args.shape, state, over, batch_args, seed=1))
            gf.append(matmul_gflops())
            gc.append(matmul_gflops(time.process_time))
            print(name, r, json.dumps({k: round(v, 4) for k, v in results[name][-1].items()}),
                  f"matmul {gf[-1]:.1f} GFLOP/s wall, {gc[-1]:.1f} cpu", flush=True)
    peak, peak_cpu = max(gf), statistics.median(gc)
    summary = {"shape": args.shape, "threads": args.threads, "tokens": tokens, "params": n_params,
               "matmul_gflops_max": round(peak, 1),
               "matmul_cpu_gflops_median": round(peak_cpu, 1), "load_avg_1m": os.getloadavg()[0],
               "hold_freed_memory": held}
    for name, rows in results.items():
        keys = [k for k in rows[0] if k.split("_cpu")[0] in ("reference", "old_log_prob", "snapshot", "update")]
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        summary[name] = {k: round(v, 3) for k, v in med.items()}
        summary[name]["frac_of_matmul"] = {k: round(flops[k] / med[k] / 1e9 / peak, 3) for k in flops}
        summary[name]["frac_of_matmul_cpu"] = {k: round(flops[k] / med[k + "_cpu"] / 1e9 / peak_cpu, 3)
                                               for k in flops}
        summary[name]["numbers"] = {k: rows[0][k] for k in ("pg_loss", "grad_norm", "weights_sum")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
