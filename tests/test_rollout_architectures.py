"""The lean forward on other Llama/Qwen2 shapes, and the HF fallback on another architecture.

Each model is built from a config, its biases and norm weights randomised so they matter, and
run through the engine; rollout log-probs must equal teacher-forced ones (<= 1e-5, fp32) for
prompts of different lengths (left padding), at two temperatures.
"""
from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.logprobs import response_log_probs
from sealrl.models.tiny import build_char_tokenizer
from sealrl.rollout import RolloutEngine
from sealrl.rollout.backends import LeanBackend, weightless_template
from sealrl.sync.manifest import build_manifest

SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build(name: str, vocab: int):
    torch.manual_seed(0)
    if name == "qwen2-gqa-tied":
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
            max_position_embeddings=128, **SPECIAL))
    elif name == "llama-mqa-bias-llama3-rope":
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, attention_bias=True,
            mlp_bias=True, max_position_embeddings=128, rope_parameters={
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}, **SPECIAL))
    elif name == "gpt-neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128, **SPECIAL))
    else:
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                           n_positions=128, **SPECIAL))
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in param_name or "ln_" in param_name:
                p.normal_(1, 0.2)
    return model.eval()


@pytest.mark.parametrize("name, backend", [("qwen2-gqa-tied", "LeanBackend"),
                                           ("llama-mqa-bias-llama3-rope", "LeanBackend"),
                                           ("gpt2", "HFBackend"), ("gpt-neox", "HFBackend")])
def test_rollout_log_probs_equal_teacher_forced(name, backend):
    tokenizer = build_char_tokenizer()
    model = build(name, len(tokenizer))
    manifest = build_manifest(model.state_dict(), "run", 0, 0, tokenizer_hash(tokenizer),
                              model_config_hash(model.config))
    engine = RolloutEngine(model, tokenizer)
    engine.load_weights(model.state_dict(), manifest)
    assert engine.backend_name == backend
    requests = [GenerationRequest("g/0", (12, 13, 14, 15, 16, 17), 1, (0, 1, 2)),
                GenerationRequest("g/1", (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2, (0, 1)),
                GenerationRequest("g/2", (20,), 3, (7,))]
    for temperature in (1.0, 0.7):
        samples = engine.generate(requests, SamplingContract(temperature=temperature,
                                                             max_new_tokens=10), manifest.version)
        prompts = [list(s.prompt_ids) for s in samples]
        responses = [list(s.response_ids) for s in samples]
        with torch.no_grad():
            lp, _, _ = response_log_probs(model, prompts, responses, temperature)
        for b, s in enumerate(samples):
            got = torch.tensor(s.rollout_log_probs)
            assert (got - lp[b, :len(got)]).abs().max() <= 1e-5, (name, temperature, b)


def test_the_hf_fallback_is_announced_once_in_one_line(capsys):
    """An architecture the lean forward lacks still trains (parity above); the user is told,
    once per engine and not once per weight version, why decoding is slower."""
    tokenizer = build_char_tokenizer()
    model = build("gpt-neox", len(tokenizer))
    engine = RolloutEngine(model, tokenizer)
    manifest = build_manifest(model.state_dict(), "run", 0, 0, tokenizer_hash(tokenizer),
                              model_config_hash(model.config))
    engine.load_weights(model.state_dict(), manifest)
    engine.load_weights(model.state_dict(), build_manifest(model.state_dict(), "run", 1, 0,
                                                           tokenizer_hash(tokenizer),
                                                           model_config_hash(model.config)))
    err = capsys.readouterr().err
    assert err == ("sealrl: rollout runs GPTNeoXForCausalLM on the HF forward, not the lean one "
                   "(model_type 'gpt_neox' is not llama/qwen2); same numbers, slower decoding\n")
    RolloutEngine(build("qwen2-gqa-tied", len(tokenizer)), tokenizer)   # lean: nothing said
    RolloutEngine(model, tokenizer, prefer_lean=False)                  # asked for: nothing said
    assert capsys.readouterr().err == ""


def test_lean_prefill_logits_equal_the_hf_forward():
    """The rewritten weights (fused, transposed, norm-folded, RoPE-paired) compute the HF
    function: last-position logits of a left-padded batch."""
    tokenizer = build_char_tokenizer()
    model = build("qwen2-gqa-tied", len(tokenizer))
    lean = LeanBackend(model.state_dict(), weightless_template(model), torch.device("cpu"))
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    valid = ids != 0
    valid[1, 0] = True
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits, _ = lean.prefill(ids, positions, valid, max_len=8)
        reference = model(input_ids=ids, attention_mask=valid.long(), position_ids=positions).logits
    assert (logits - reference[:, -1]).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_weights_equal_cat_fold_transpose(dtype):
    """The lean backend writes each stacked weight straight into its transposed slot: bit for
    bit what concatenating, folding the norm in and transposing gives, biases and shapes of
    q/k/v (GQA: k and v smaller) and gate/up, with and without a norm."""
    from sealrl.rollout.lean import _stack_t
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, 48, generator=g).to(dtype) for rows in (48, 16, 16))
    norm = (1 + torch.randn(48, generator=g)).to(dtype)
    assert torch.equal(_stack_t(q, k, v, norm=norm), (torch.cat([q, k, v]) * norm[None, :]).t().contiguous())
    assert torch.equal(_stack_t(q), q.t().contiguous())
    out = _stack_t(q, k, norm=norm.float())   # a norm in another dtype promotes, as `*` does
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out, (torch.cat([q, k]) * norm.float()[None, :]).t().contiguous())
