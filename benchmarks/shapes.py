"""Model folders for benchmarks/vs_trl.py --shape: the embedded model (tiny), the random-init
mid layout (sealrl/models/synthetic.py, written to a work folder), the random-init `llama`
layout below (a shape none of the others has, to check that the speed carries past them), the
mid layout with Qwen2.5's 151,936-token vocabulary (`qwenvocab`: a vocabulary four times the
others'), or the converted SmolLM2-135M-Instruct folder (None when it is absent)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sealrl.models.hf import save_causal_lm
from sealrl.models.synthetic import build_mid, padded_char_tokenizer, save_mid

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "sealrl" / "assets" / "arith-tiny"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
LLAMA_VOCAB = 32000
QWEN_VOCAB = 151936   # Qwen2.5 / Qwen3


def save_llama(folder: Path, seed: int = 0) -> Path:
    """A Llama layout unlike the other shapes: an untied LM head, a 32,000-token vocabulary (as
    Llama 2 and Mistral), full multi-head attention (8 heads of 64, no GQA), hidden 512, 4 layers,
    MLP 1,376: 45.4M parameters, 32.8M of them the embedding and the head. Random init, so
    responses run to max_new_tokens; the embedded character tokenizer padded to the vocabulary."""
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False,
                         max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return save_causal_lm(LlamaForCausalLM(config).float().eval(), padded_char_tokenizer(LLAMA_VOCAB), folder)


def model_folder(shape: str, workdir: Path, smollm2: Path | None = None) -> Path | None:
    if shape == "tiny":
        return TINY
    if shape == "mid":
        return save_mid(workdir / "mid-model")
    if shape == "llama":
        return save_llama(workdir / "llama-model")
    if shape == "qwenvocab":   # the mid layout, its tied head 151,936 wide: 67.8M parameters, 58.3M of them the head
        return save_causal_lm(*build_mid(vocab_size=QWEN_VOCAB), workdir / "qwenvocab-model")
    path = smollm2 or SMOLLM2
    return path if (path / "config.json").is_file() else None
