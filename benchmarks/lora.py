"""LoRA (rank 16, every linear layer) against full fine-tuning on the mid shape: peak RSS,
seconds per iteration and bytes per weight sync, each mode in its own subprocess.

    .venv/bin/python benchmarks/lora.py [--iterations 3] [--threads 1] [--output-dir /tmp/sealrl-lora-bench]

The mid shape: a random-init Qwen2 (GQA 8 query / 2 key-value heads, tied embeddings, a
16,384-token vocabulary, hidden 512, 3 layers, 15.7M parameters), GRPO on the arithmetic task
with 16 prompts x 8 candidates and 64-token responses (a random model rarely stops early).
Seconds per iteration are the mean over the iterations after the first (warm-up). Peak RSS is
the subprocess's own maximum resident set (ru_maxrss), model building and evaluation included.
Prints one JSON line per mode, then a final JSON line with both and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # as the CLI sets it

MODES = {"full": [], "lora": ["actor.lora.rank=16", "actor.lora.alpha=32", "actor.lora.target_modules=all-linear"]}


def build_mid_shape(folder: Path) -> Path:
    """The mid-shape model folder: random-init Qwen2 + a 16,384-token tokenizer (the embedded
    character tokenizer's tokens first, filler tokens after, so arithmetic prompts encode)."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from sealrl.models.hf import save_causal_lm
    from sealrl.models.tiny import BOS, CHARACTERS, EOS, PAD, SPECIAL_TOKENS, UNK
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), 16384)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=UNK)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=16384, hidden_size=512, intermediate_size=1152, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return save_causal_lm(model, tokenizer, folder)


def worker(mode: str, model_dir: str, out: str, iterations: int, threads: int) -> dict:
    """One training run in this process; its figures."""
    from sealrl.config import load_config
    from sealrl.trainer.driver import train
    cfg = load_config(None, [f"model.path={model_dir}", f"run.output_dir={out}", f"run.name={mode}",
                             f"run.iterations={iterations}", "run.checkpoint_every=0",
                             f"run.threads={threads}", "data.prompts_per_iter=16", "rollout.n=8",
                             "rollout.max_new_tokens=64", "eval.num=16", "actor.micro_batch_size=32",
                             "algorithm.old_log_prob=bypass", "run.loggers=", *MODES[mode]])
    train(cfg)
    rows = [json.loads(x) for x in (Path(out) / mode / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    return {"mode": mode, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "s_per_iteration": round(sum(r["time/iteration_s"] for r in timed) / len(timed), 3),
            "sync_bytes": int(rows[-1]["sync/bytes"]), "iterations": len(rows)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output-dir", default="/tmp/sealrl-lora-bench")
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    model_dir = out / "mid_shape"
    if args.worker:
        print(json.dumps(worker(args.worker, str(model_dir), str(out), args.iterations, args.threads)))
        return 0
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    build_mid_shape(model_dir)
    results = {}
    for mode in MODES:   # one after the other, each in a fresh interpreter: its own peak RSS
        proc = subprocess.run([sys.executable, __file__, "--worker", mode, "--iterations", str(args.iterations),
                               "--threads", str(args.threads), "--output-dir", str(out)],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-3000:])
            return proc.returncode
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[mode]), flush=True)
    full, lora = results["full"], results["lora"]
    print(json.dumps({"full": full, "lora": lora,
                      "sync_bytes_ratio": round(lora["sync_bytes"] / full["sync_bytes"], 4),
                      "peak_rss_ratio": round(lora["peak_rss_mib"] / full["peak_rss_mib"], 3),
                      "s_per_iteration_ratio": round(lora["s_per_iteration"] / full["s_per_iteration"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
