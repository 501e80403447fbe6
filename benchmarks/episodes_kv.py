"""Multi-turn generation time: turns continued from their kept KV cache vs prefilled again.

The episodes of `examples/arith_tools.yaml`'s first iteration: the embedded tool model
(sealrl/assets/arith-tools), 16 mul3 prompts x 8 episodes, temperature 1.0, 24 new tokens per
turn, env.name=calc with 2 turns, 64 tokens per episode, observations of at most 24 tokens.
Each repeat plays the same episodes both ways (the same seeds: the ids are checked equal),
alternating which goes first so that load from other processes hits both alike; medians are
compared. Tool calls run in the calc worker process for both.

Run:
    .venv/bin/python benchmarks/episodes_kv.py [--repeats 7] [--threads 1] [--weights FILE]

The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see benchmarks/rollout.py

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from sealrl.data.dataset import prompts_from_rows  # noqa: E402
from sealrl.data.tasks import make_task  # noqa: E402
from sealrl.envs import make_env  # noqa: E402
from sealrl.experience.records import SamplingContract  # noqa: E402
from sealrl.experience.wire import GenerationRequest, env_input  # noqa: E402
from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash  # noqa: E402
from sealrl.rollout import RolloutEngine  # noqa: E402
from sealrl.rollout.episodes import EpisodeRunner, EpisodeSpec  # noqa: E402
from sealrl.sync.manifest import build_manifest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--weights", default="", help="a safetensors file of policy weights to use instead of the "
                    "warm start's (e.g. a run's checkpoints/step_N/<policy part>.safetensors)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_causal_lm("sealrl/assets/arith-tools")
    if args.weights:
        model.load_state_dict(load_file(args.weights), strict=True)
    manifest = build_manifest(model.state_dict(), "bench", 0, 0, tokenizer_hash(tok), model_config_hash(model.config))
    engine = RolloutEngine(model, tok)
    engine.load_weights(model.state_dict(), manifest)
    prompts = prompts_from_rows(make_task("mul3", "train", args.prompts * args.repeats, 0), tok, 32).prompts
    contract = SamplingContract(max_new_tokens=24, temperature=1.0)
    spec = EpisodeSpec("calc", max_turns=2, max_tokens=64, max_observation_tokens=24)
    env = make_env("calc", 2.0)
    runners = {"reuse": EpisodeRunner(spec, tok, env=env), "prefill": EpisodeRunner(spec, tok, env=env, reuse_kv=False)}
    times: dict[str, list[float]] = {k: [] for k in runners}
    fed = {k: 0 for k in runners}   # tokens run through the model before decoding (prefill or continued feed)

    def counting(name):
        def generate(reqs, c, version, kv=None):
            before = 0 if kv is None else kv.fed_tokens
            out = engine.generate(reqs, c, version, kv=kv)
            fed[name] += kv.fed_tokens - before if kv is not None else \
                sum(len(p) for p in dict.fromkeys(r.prompt_ids for r in reqs))
            return out
        return generate

    turns = tokens = 0
    try:
        for r in range(args.repeats):
            batch = prompts[r * args.prompts:(r + 1) * args.prompts]
            reqs = [GenerationRequest(f"bench/{r}/{p.prompt_id}", tuple(p.token_ids), 1000 * r + i,
                                      tuple(range(args.n)), env_input(p)) for i, p in enumerate(batch)]
            out = {}
            for name in (("reuse", "prefill") if r % 2 == 0 else ("prefill", "reuse")):
                t0 = time.perf_counter()
                out[name] = runners[name].generate(counting(name), reqs, contract, manifest.version)
                times[name].append(time.perf_counter() - t0)
            assert [s.response_ids for s in out["reuse"]] == [s.response_ids for s in out["prefill"]]
            turns += sum(len(s.episode.turns) for s in out["reuse"])
            tokens += sum(len(s.response_ids) for s in out["reuse"])
    finally:
        env.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    episodes = args.repeats * args.prompts * args.n
    print(f"{episodes} episodes, {turns / episodes:.2f} turns each, {tokens / episodes:.1f} response tokens each")
    print(f"tokens fed before decoding: {fed['reuse']} with the turn cache, {fed['prefill']} re-prefilling")
    for k, v in times.items():
        runs = ", ".join(f"{x:.3f}" for x in v)
        print(f"{k:8s} median {med[k]:.3f} s per {args.prompts}x{args.n} episodes  (all: {runs})")
    print(json.dumps({"threads": args.threads, "repeats": args.repeats, "median_s": med,
                      "speedup": med["prefill"] / med["reuse"], "turns_per_episode": turns / episodes,
                      "fed_tokens": fed}))


if __name__ == "__main__":
    main()
