"""The lean teacher-forced forward (models/lean_forward.py, actor.lean_forward) against the HF
forward it replaces: log-probs, entropy, critic values and every parameter's gradient within
1e-5 in fp32, padded and packed, full and chunked logits, Llama (MHA, biases) and Qwen2 (GQA,
tied embeddings, q/k/v biases), sequences of unequal and of equal lengths, LoRA; and the HF
forward, bit for bit, where the lean one does not apply. Shared prompts (actor.share_prompts:
each distinct prompt of a micro-batch run once) against the HF forward on every copy, the same
quantities and tolerance."""
from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from sealrl.config import ConfigError, build_config
from sealrl.models.critic import CriticModel
from sealrl.models.lean_forward import MATH_ATTENTION_MAX_LEN, lean_hidden, unsupported_reason
from sealrl.models.lora import apply_lora
from sealrl.models.packing import TeacherForcing, pack_sequences, pack_shared_prompts
from sealrl.roles.common import teacher_forcing
from tests.test_models_packing import PROMPTS, RESPONSES, qwen2_gqa_tied

TOL = 1e-5
EQUAL_PROMPTS, EQUAL_RESPONSES = [[3, 4, 5], [6, 7, 8], [9, 10, 11]], [[12, 13], [14, 15], [16, 17]]
# rows longer than lean_forward.MATH_ATTENTION_MAX_LEN: the fused attention kernel with gradients
LONG_PROMPTS, LONG_RESPONSES = [list(range(3, 23)), [5, 6]], [list(range(30, 42)), [7, 8, 9]]


def llama_biased():
    """A Llama layout with biases on attention and MLP (the o_proj bias takes the module path)."""
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    return LlamaForCausalLM(cfg).eval()


MODELS = {"llama_biased": llama_biased, "qwen2_gqa_tied": qwen2_gqa_tied}


def run(model, tf, prompts, responses, temperature=0.7):
    """(log-probs, entropy, {name: grad}) of loss = sum lp + 0.3 sum entropy, fresh gradients."""
    model.zero_grad(set_to_none=True)
    lp, ent, mask = tf.log_probs(model, prompts, responses, temperature, 0, with_entropy=True)
    (lp.sum() + 0.3 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), mask, grads


def assert_close(a, b):
    assert a[2].tolist() == b[2].tolist()  # response masks
    assert (a[0] - b[0]).abs().max() <= TOL and (a[1] - b[1]).abs().max() <= TOL
    assert a[3].keys() == b[3].keys()
    for name in a[3]:
        assert (a[3][name] - b[3][name]).abs().max() <= TOL, name


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("chunk", [0, 3])
def test_lean_equals_hf(name, pack, chunk):
    model = MODELS[name]().train()  # train mode: no dropout in these configs, so lean applies
    assert unsupported_reason(model) is None
    assert len(LONG_PROMPTS[0]) + len(LONG_RESPONSES[0]) > MATH_ATTENTION_MAX_LEN
    for prompts, responses in ((PROMPTS, RESPONSES), (EQUAL_PROMPTS, EQUAL_RESPONSES), (LONG_PROMPTS, LONG_RESPONSES)):
        hf = run(model, TeacherForcing(pack=pack, chunk=chunk), prompts, responses)
        lean = run(model, TeacherForcing(pack=pack, chunk=chunk, lean=True), prompts, responses)
        assert_close(hf, lean)
        assert lean[0].abs().sum() > 0 and len(lean[3]) == sum(1 for _ in model.parameters())


def test_lean_hidden_is_per_sequence():
    """Each sequence's states depend on its own tokens only: a sequence alone == within a batch."""
    model = qwen2_gqa_tied()
    packed = pack_sequences(PROMPTS, RESPONSES)
    index = packed.predicting_index(extra=1)
    together = lean_hidden(model, packed.input_ids[0], packed.lengths, index)
    alone = []
    for p, r in zip(PROMPTS, RESPONSES):
        one = pack_sequences([p], [r])
        alone.append(lean_hidden(model, one.input_ids[0], one.lengths, one.predicting_index(extra=1)))
    assert (together - torch.cat(alone)).abs().max() <= TOL


def test_lean_critic_values_equal_hf():
    torch.manual_seed(5)
    critic = CriticModel.from_causal_lm(qwen2_gqa_tied()).train()
    out = {}
    for lean in (False, True):
        critic.zero_grad(set_to_none=True)
        values, last, mask = TeacherForcing(lean=lean).values(critic, PROMPTS, RESPONSES, 0)
        (values.sum() + 2 * last.sum()).backward()
        out[lean] = values.detach(), last.detach(), mask, {n: p.grad.clone() for n, p in critic.named_parameters()}
    (v0, l0, m0, g0), (v1, l1, m1, g1) = out[False], out[True]
    assert m0.tolist() == m1.tolist()
    assert (v0 - v1).abs().max() <= TOL and (l0 - l1).abs().max() <= TOL
    assert all((g0[n] - g1[n]).abs().max() <= TOL for n in g0)


def test_lean_with_lora_adapter():
    """LoRA-wrapped projections are called as modules: the adapter applies, its factors get
    the HF gradients, and with the adapter disabled the result is the base model's."""
    model = qwen2_gqa_tied()
    cfg = build_config(None, ["actor.lora.rank=4", "actor.lora.dropout=0.0"]).actor.lora
    peft_model = apply_lora(model, cfg, "actor.lora", seed=0).train()
    with torch.no_grad():  # B starts at 0: make the adapter do something
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    assert unsupported_reason(peft_model) is None
    hf = run(peft_model, TeacherForcing(), PROMPTS, RESPONSES)
    lean = run(peft_model, TeacherForcing(lean=True), PROMPTS, RESPONSES)
    assert_close(hf, lean)
    assert any("lora_A" in n for n in lean[3]) and not any("base_layer" in n for n in lean[3])
    with peft_model.disable_adapter(), torch.no_grad():
        off = TeacherForcing(lean=True).log_probs(peft_model, PROMPTS, RESPONSES, 0.7, 0)[0]
    base = TeacherForcing().log_probs(qwen2_gqa_tied(), PROMPTS, RESPONSES, 0.7, 0)[0]
    assert (off - base).abs().max() <= TOL and (off - lean[0]).abs().max() > 1e-3


def test_unsupported_falls_back_to_hf_bitwise():
    model = qwen2_gqa_tied()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert unsupported_reason(model) == "gradient checkpointing is on"
    with torch.no_grad():
        a = TeacherForcing().log_probs(model, PROMPTS, RESPONSES, 1.0, 0)[0]
        b = TeacherForcing(lean=True).log_probs(model, PROMPTS, RESPONSES, 1.0, 0)[0]
    assert torch.equal(a, b)
    assert unsupported_reason(qwen2_gqa_tied().to(torch.bfloat16)) == "weights are not fp32"
    dropout = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, attention_dropout=0.1))
    assert unsupported_reason(dropout.eval()) is None and unsupported_reason(dropout.train()) == \
        "attention dropout is in force"


def test_the_fast_path_is_chosen_for_the_model_and_run_exact_is_the_hf_path():
    cfg = build_config(None, ["actor.micro_batch_size=20"]).actor
    fast = teacher_forcing(cfg, qwen2_gqa_tied(), exact=False, group=8)
    assert (fast.lean, fast.share_prompts, fast.chunk, fast.keep_logits) == (True, True, 1024, True)
    assert fast.micro_batch_size == 16   # whole groups of 8 in a micro-batch
    exact = teacher_forcing(cfg, qwen2_gqa_tied(), exact=True, group=8)
    assert exact == TeacherForcing(micro_batch_size=20)   # the HF reference path: padded, whole head
    gpt2 = teacher_forcing(cfg, GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40)), False)
    assert (gpt2.lean, gpt2.pack, gpt2.chunk) == (False, False, 1024)   # no lean forward: HF padded, chunked head
    default = build_config(None, []).actor   # micro_batch_size unset: whole groups by tokens; exact: 64 samples
    assert teacher_forcing(default, qwen2_gqa_tied(), exact=False, group=8).micro_batches([10] * 128) == \
        [list(range(128))]
    assert teacher_forcing(default, qwen2_gqa_tied(), exact=True, group=8) == TeacherForcing(micro_batch_size=64)
    memory = teacher_forcing(build_config(None, ["actor.logit_chunk_tokens=256"]).actor, qwen2_gqa_tied(), False)
    assert (memory.chunk, memory.keep_logits) == (256, False)   # an explicit chunk recomputes (less memory)


# groups of samples with one prompt (a GRPO batch), a lone prompt, an empty response
GROUP_PROMPTS = [[11, 12, 14, 8, 6], [11, 12, 14, 8, 6], [5, 9], [11, 12, 14, 8, 6], [20], [5, 9]]
GROUP_RESPONSES = [[4, 5, 2], [7, 7, 1, 3, 9], [2, 2], [], [5, 6, 7, 8], [3]]


def test_shared_prompt_layout():
    packed = pack_shared_prompts([[1, 2, 3], [1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10], [11]])
    assert packed.input_ids[0].tolist() == [1, 2, 3, 6, 7, 8, 9, 10, 4, 5, 11]
    assert packed.rows == ((0, 1, 2, 3, 4), (0, 1, 2, 5, 6, 7), (8, 9, 10))
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2]
    assert packed.predicting_index().tolist() == [2, 3, 2, 5, 6, 9]   # prompt's last state serves both
    assert packed.predicting_index(extra=1).tolist() == [2, 3, 4, 2, 5, 6, 7, 9, 10]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("chunk", [0, 3])
def test_shared_prompts_equal_hf(name, chunk):
    """Log-probs, entropy and every gradient of the shared-prompt forward equal the HF forward
    run on every sample's own copy of its prompt."""
    model = MODELS[name]().train()
    hf = run(model, TeacherForcing(pack=True, chunk=chunk), GROUP_PROMPTS, GROUP_RESPONSES)
    shared = run(model, TeacherForcing(chunk=chunk, lean=True, share_prompts=True), GROUP_PROMPTS, GROUP_RESPONSES)
    assert_close(hf, shared)
    assert shared[0].abs().sum() > 0 and len(shared[3]) == sum(1 for _ in model.parameters())
    stored = pack_shared_prompts(GROUP_PROMPTS, GROUP_RESPONSES).input_ids.shape[1]
    assert stored == 5 + 2 + 1 + sum(map(len, GROUP_RESPONSES))   # three prompts, each once


def test_shared_prompts_critic_values_equal_hf():
    torch.manual_seed(5)
    critic = CriticModel.from_causal_lm(qwen2_gqa_tied()).train()
    out = {}
    for tf in (TeacherForcing(pack=True), TeacherForcing(lean=True, share_prompts=True)):
        critic.zero_grad(set_to_none=True)
        values, last, mask = tf.values(critic, GROUP_PROMPTS, GROUP_RESPONSES, 0)
        (values.sum() + 2 * last.sum()).backward()
        out[tf.lean] = values.detach(), last.detach(), mask, {n: p.grad.clone() for n, p in critic.named_parameters()}
    (v0, l0, m0, g0), (v1, l1, m1, g1) = out[False], out[True]
    assert m0.tolist() == m1.tolist() and l1.abs().sum() > 0
    assert (v0 - v1).abs().max() <= TOL and (l0 - l1).abs().max() <= TOL
    for n in g0:  # gradients reach ~50 here (sums over many values): 1e-5 relative to their scale
        assert (g0[n] - g1[n]).abs().max() <= TOL * max(1.0, g0[n].abs().max().item()), n


def test_the_removed_speed_keys_say_what_replaced_them():
    for key in ("actor.lean_forward", "actor.share_prompts", "actor.pack_sequences", "actor.fused_adamw"):
        with pytest.raises(ConfigError, match=f"{key} was removed: .*run.exact=true"):
            build_config(None, [f"{key}=true"])
