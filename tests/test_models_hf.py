"""Load/save of HF causal LMs and the tokenizer/config fingerprints roles compare."""
from __future__ import annotations

import pytest
import torch

from sealrl.models.hf import (
    TokenizerMismatchError,
    check_same_tokenizer,
    load_causal_lm,
    model_config_hash,
    save_causal_lm,
    tokenizer_hash,
)
from sealrl.models.tiny import build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, tokenizer = build_tiny_model(seed=3, hidden_size=32, num_layers=2, intermediate_size=64)
    folder = save_causal_lm(model, tokenizer, tmp_path_factory.mktemp("tiny"))
    return model, tokenizer, folder


def test_save_writes_safetensors_only(saved):
    _, _, folder = saved
    names = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)  # no pickle


def test_round_trip_gives_identical_logits(saved):
    model, tokenizer, folder = saved
    loaded, loaded_tok = load_causal_lm(folder)
    assert not loaded.training
    ids = torch.tensor([tokenizer("07+45=25", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tok.get_vocab() == tokenizer.get_vocab()


def test_load_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model folder"):
        load_causal_lm(tmp_path)


def test_tokenizer_hash_survives_round_trip_and_sees_changes(saved):
    _, tokenizer, folder = saved
    _, loaded_tok = load_causal_lm(folder)
    assert tokenizer_hash(loaded_tok) == tokenizer_hash(tokenizer)
    other_template = build_char_tokenizer()
    other_template.chat_template = "{{ messages[0]['content'] }}!"
    assert tokenizer_hash(other_template) != tokenizer_hash(tokenizer)
    extra_token = build_char_tokenizer()
    extra_token.add_tokens(["<tool>"])
    assert tokenizer_hash(extra_token) != tokenizer_hash(tokenizer)


def test_model_config_hash_ignores_dtype_and_path_not_architecture(saved):
    model, _, folder = saved
    bf16, _ = load_causal_lm(folder, dtype=torch.bfloat16)
    assert model_config_hash(bf16.config) == model_config_hash(model.config)
    deeper, _ = build_tiny_model(seed=3, hidden_size=32, num_layers=3, intermediate_size=64)
    assert model_config_hash(deeper.config) != model_config_hash(model.config)


def test_check_same_tokenizer_names_the_pair():
    check_same_tokenizer("a" * 64, "a" * 64, "actor vs rollout")
    with pytest.raises(TokenizerMismatchError, match="actor vs rollout"):
        check_same_tokenizer("a" * 64, "b" * 64, "actor vs rollout")


def test_load_and_save_print_no_progress_bars_and_restore_the_setting(saved, tmp_path, capsys):
    """A run loads and saves folders at every checkpoint: transformers' "Loading weights" /
    "Writing model shards" bars would flood the log. They are off inside, restored after."""
    from transformers.utils import logging as hf_logging
    model, tokenizer, folder = saved
    hf_logging.enable_progress_bar()
    load_causal_lm(folder)
    save_causal_lm(model, tokenizer, tmp_path / "again")
    out = capsys.readouterr()
    assert "Loading weights" not in out.err + out.out and "Writing model shards" not in out.err + out.out
    assert hf_logging.is_progress_bar_enabled()
