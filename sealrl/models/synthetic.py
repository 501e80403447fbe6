"""Random-init models of realistic layout, for benchmarks and tests at real shapes.

`mid`: a Qwen2 layout with grouped-query attention (6 query heads, 2 KV heads, head dim 64),
tied input/output embeddings, hidden 384, 6 layers, MLP 1024, vocabulary 16,384: 15.73M
parameters, 6.29M of them the (tied) embedding. Its tokenizer is the embedded character
tokenizer (so the arithmetic prompts read the same) padded with filler tokens `<x123>` up to
the vocabulary size. Random init means EOS is almost never sampled, so responses run to
max_new_tokens. Deterministic in the seed; nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from sealrl.models.hf import save_causal_lm
from sealrl.models.tiny import BOS, CHARACTERS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, UNK

MID_VOCAB = 16384


def padded_char_tokenizer(vocab_size: int = MID_VOCAB) -> PreTrainedTokenizerFast:
    """The embedded character tokenizer with filler tokens `<xN>` up to `vocab_size` ids."""
    base = SPECIAL_TOKENS + tuple(CHARACTERS)
    vocab = {tok: i for i, tok in enumerate(base + tuple(f"<x{i}>" for i in range(len(base), vocab_size)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def mid_config(vocab_size: int = MID_VOCAB, hidden: int = 384, layers: int = 6, heads: int = 6,
               kv_heads: int = 2, mlp: int = 1024) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                       max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_mid(seed: int = 0, **overrides) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """(model in eval mode, tokenizer); `overrides` shrink the layout for tests."""
    config = mid_config(**overrides)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float().eval(), padded_char_tokenizer(config.vocab_size)


def save_mid(folder: Path, seed: int = 0) -> Path:
    """Write the mid model and its tokenizer to `folder` (the save_pretrained layout)."""
    return save_causal_lm(*build_mid(seed), folder)
