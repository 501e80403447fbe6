"""The embedded default model: a small Llama with a character-level tokenizer.

Both are ordinary Hugging Face objects (LlamaForCausalLM, PreTrainedTokenizerFast built with
the `tokenizers` library), so a trained policy saves and loads with transformers like any other
causal LM. Nothing here downloads anything.
"""
from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Digits and operators first so the arithmetic vocabulary has small, stable ids.
ARITH_CHARACTERS = string.digits + "+-*/=()., :;?!<>'\"\n" + string.ascii_lowercase + string.ascii_uppercase
# The rest of printable ASCII (GSM8K's "####", LaTeX's \ { } ^ _ $, markdown's | [ ] ...) and the
# tab, appended so the ids above do not move. \r, \v and \f stay unknown: a row holding one is
# refused by the dataset loader, which names the character.
CHARACTERS = ARITH_CHARACTERS + "".join(c for c in string.punctuation if c not in ARITH_CHARACTERS) + "\t"
# Messages are concatenated as they are: the tiny model has no roles.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; unknown characters map to <unk>."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARACTERS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS,
                                 eos_token=EOS, unk_token=UNK)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def tiny_llama_config(vocab_size: int, hidden_size: int = 128, num_layers: int = 4,
                      num_heads: int = 4, intermediate_size: int = 512,
                      max_positions: int = 128) -> LlamaConfig:
    """About 1M parameters at the defaults: big enough to learn 2-digit addition, small
    enough to train in minutes on two CPU cores."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )


def build_tiny_model(seed: int = 0, **config_overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised tiny Llama and its char tokenizer (deterministic in `seed`)."""
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.eval()
    return model, tokenizer
