"""LoRA (models/lora.py, sync/adapter.py): config, the reference as the base with the adapter
off, adapter-only sync verified like full weights, export, and what a sync moves."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from sealrl.config import ActorConfig, AlgorithmConfig, ConfigError, LoraConfig, load_config
from sealrl.experience import (
    ExperienceBatch,
    PolicyVersion,
    Role,
    SampleMeta,
    SamplingContract,
    StopReason,
    group_id,
    sample_id,
)
from sealrl.experience.wire import GenerationRequest
from sealrl.models.hf import load_causal_lm, model_config_hash, save_causal_lm, tokenizer_hash
from sealrl.models.logprobs import response_log_probs
from sealrl.models.lora import adapter_scaling, adapter_state, apply_lora, base_state, has_lora, save_policy
from sealrl.models.tiny import build_char_tokenizer, build_tiny_model
from sealrl.placement.rollout_pool import RolloutPool
from sealrl.placement.workers import LocalWorkerGroup
from sealrl.roles.actor import Actor
from sealrl.roles.common import batch_log_probs
from sealrl.roles.reference import Reference
from sealrl.roles.rollout import Rollout
from sealrl.sync.adapter import merge_adapter, rollout_copy, sync_bytes
from sealrl.sync.manifest import WeightSyncError, build_manifest, in_dtype

SMALL = dict(hidden_size=32, num_layers=2, intermediate_size=64)
LORA = LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")
PROMPTS = [[11, 12, 14, 8], [6, 18, 9]]
RESPONSES = [[5, 6, 2], [7, 8, 9, 10]]
V0 = PolicyVersion("run", 0)


def _plain_model(arch="llama"):
    """The embedded Llama layout, or a Qwen2 one (GQA, q/k/v biases, tied embeddings), tiny."""
    if arch == "llama":
        return build_tiny_model(seed=0, **SMALL)
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True, max_position_embeddings=64)).eval(), tok


def _peft(arch="llama"):
    """A tiny policy with an adapter whose B factors are random (a trained adapter: not a no-op)."""
    model, tok = _plain_model(arch)
    peft = apply_lora(model, LORA, "actor.lora", seed=1)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, t in adapter_state(peft).items():
            if name.endswith("lora_B"):
                t.normal_(0, 0.2)
    return peft.eval(), tok


def _actor(model, tok):
    return Actor(model, ActorConfig(lr=1e-3), AlgorithmConfig(), "run", tokenizer_hash(tok), 1.0,
                 tok.pad_token_id, 10, 8)


def _batch():
    metas = [SampleMeta(sample_id=sample_id(group_id("run", 0, f"p{i}"), 0), group_id=group_id("run", 0, f"p{i}"),
                        prompt_id=f"p{i}", prompt_ids=tuple(p), response_ids=tuple(r), stop_reason=StopReason.LENGTH,
                        policy_version=V0.id, seed=i) for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
    return ExperienceBatch("run", 0, metas, SamplingContract(max_new_tokens=4, n=1), [V0])


def test_nested_overrides_and_a_target_that_matches_nothing():
    cfg = load_config(None, ["actor.lora.rank=16", "actor.lora.target_modules=all-linear"])
    assert (cfg.actor.lora.rank, cfg.actor.lora.target_modules) == (16, "all-linear")
    with pytest.raises(ConfigError, match="config key critic.lora was removed: the critic follows actor.lora"):
        load_config(None, ["critic.lora.rank=2"])
    assert cfg.to_dict()["actor"]["lora"] == {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
    assert load_config(None, []).actor.lora.rank == 0   # off by default
    with pytest.raises(ConfigError, match=r"unknown config key actor.lora.rnk; did you mean 'rank'"):
        load_config(None, ["actor.lora.rnk=3"])
    with pytest.raises(ConfigError, match=r"^actor.lora must be rank >= 0.*rank=-1 .*override actor.lora.rank=-1"):
        load_config(None, ["actor.lora.rank=-1"])
    model, _ = build_tiny_model(seed=0, **SMALL)
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules: 'qq_proj' matches no linear layer") as e:
        apply_lora(model, dataclasses.replace(LORA, target_modules="q_proj,qq_proj"), "actor.lora", seed=0)
    assert "\n" not in str(e.value)
    assert not has_lora(model)   # refused before anything was injected
    # Ray replicas pin the base; data-parallel ranks train the adapter (tests/test_train_group.py)
    load_config(None, ["actor.lora.rank=4", "placement.backend=ray", "placement.actor_ranks=2"])


def _saved_base_and_policy(tmp_path, set_b):
    """A tiny base saved to tmp_path/base, reloaded with a LoRA adapter whose B factors `set_b`
    fills (peft starts them at 0, which would make the adapter a no-op)."""
    plain, tok = build_tiny_model(seed=0, **SMALL)
    save_causal_lm(plain, tok, tmp_path / "base")
    policy, _ = load_causal_lm(tmp_path / "base")
    policy = apply_lora(policy, LORA, "actor.lora", seed=1)
    with torch.no_grad():
        for name, t in adapter_state(policy).items():
            if name.endswith("lora_B"):
                set_b(t)
    return policy, tok


def test_reference_is_the_base_with_the_adapter_off_bitwise(tmp_path):
    policy, tok = _saved_base_and_policy(tmp_path, lambda t: t.fill_(0.3))
    policy.train()   # the actor's mode is restored after the reference's forward
    actor = _actor(policy, tok)
    ref = Reference(policy, dataclasses.replace(actor.base.version, run_id="reference:base-adapter-off"),
                    1.0, tok.pad_token_id, adapter_off=True)
    batch = _batch()
    ref.compute(batch)
    base, _ = load_causal_lm(tmp_path / "base")   # a separately loaded base model, fp32
    want, _ = batch_log_probs(base, batch, 1.0, tok.pad_token_id, 64)
    assert torch.equal(batch.get("ref_log_probs"), want)
    assert policy.training
    with_adapter, _ = batch_log_probs(policy, batch, 1.0, tok.pad_token_id, 64)
    assert not torch.equal(with_adapter, want)   # the adapter does change the policy
    # the producer is the reference role, and its version is the base's own weights hash
    assert batch.provenance("ref_log_probs") == (Role.REFERENCE, ref.version.id)
    full = build_manifest(base.state_dict(), "base", 0, 0, tokenizer_hash(tok), model_config_hash(base.config))
    assert ref.version.weights_hash == full.version.weights_hash
    assert ref.version.id.startswith("reference:base-adapter-off@0.0#")


def test_merge_is_w_plus_scaled_b_a():
    w = torch.zeros(2, 3)
    a, b = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0], [2.0]])   # r = 1
    merged = merge_adapter({"l.weight": w, "l.bias": torch.ones(2)}, {"l.lora_A": a, "l.lora_B": b}, {"l": 0.5})
    # B @ A = [[1, 2, 3], [2, 4, 6]]; times 0.5
    assert torch.equal(merged["l.weight"], torch.tensor([[0.5, 1.0, 1.5], [1.0, 2.0, 3.0]]))
    assert merged["l.bias"] is not None and torch.equal(w, torch.zeros(2, 3))   # the base is never written


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_adapter_sync_serves_the_trained_policy_and_names_its_base(arch):
    model, tok = _peft(arch)
    actor = _actor(model, tok)
    rollout = Rollout(_plain_model(arch)[0], tok)
    rollout.pin_base(base_state(model), actor.base)
    state, manifest = actor.export()
    assert set(state) == set(adapter_state(model))   # only adapter tensors travel
    assert manifest.base_hash == actor.base.version.weights_hash
    version = rollout.load(state, manifest)
    out = rollout.generate([GenerationRequest("run/0/p", tuple(PROMPTS[0]), 3, (0, 1))],
                           SamplingContract(max_new_tokens=4), version)
    lp, _, _ = response_log_probs(model, [list(s.prompt_ids) for s in out], [list(s.response_ids) for s in out])
    for i, s in enumerate(out):
        assert torch.allclose(torch.tensor(s.rollout_log_probs), lp[i, :len(s.response_ids)], atol=1e-5)
    assert rollout.backend[0] == "LeanBackend"   # the merged weights run the lean forward
    # another base under the same adapter: refused by hash
    other, _ = _plain_model(arch)
    with torch.no_grad():
        other.model.norm.weight.add_(0.5)
    fresh = Rollout(other, tok)
    fresh.pin_base(other.state_dict(), build_manifest(other.state_dict(), "base", 0, 0, *_hashes(other, tok)))
    with pytest.raises(WeightSyncError, match="'<base>'.*this replica pinned base"):
        fresh.load(state, manifest)
    with pytest.raises(WeightSyncError, match="needs a pinned base"):
        Rollout(other, tok).load(state, manifest)


def test_a_bf16_rollout_pins_a_bf16_base_and_rounds_each_merged_weight_once():
    """rollout.dtype=bf16 with LoRA: the rollout pins the base cast to bf16 (a base of its own
    hash), each adapter version is named against it (a version of its own, at the same step;
    its factors stay fp32), and the engine samples with bf16(bf16(W) + s * B @ A): its
    log-probs are those of a bf16 model holding those weights, within bf16's parity bound
    (0.25 nats, tests/test_rollout_large_vocab.py)."""
    model, tok = _peft()
    actor = _actor(model, tok)
    rollout = Rollout(_plain_model()[0], tok)
    base16, base_manifest16 = in_dtype(base_state(model), actor.base, "bf16")
    pinned = rollout.pin_base(base16, base_manifest16)
    assert pinned == base_manifest16.version.weights_hash != actor.base.version.weights_hash
    state, manifest = actor.export()
    assert rollout_copy(state, manifest, "fp32", actor.base.version.weights_hash) == (state, manifest)
    state16, manifest16 = rollout_copy(state, manifest, "bf16", pinned)
    assert state16 is state and manifest16.base_hash == pinned
    assert manifest16.version.step == manifest.version.step
    assert manifest16.version.weights_hash != manifest.version.weights_hash
    with pytest.raises(WeightSyncError, match="this replica pinned base"):   # the fp32-base version: refused
        rollout.load(state, manifest)
    version = rollout.load(state16, manifest16)
    assert rollout.backend == ("LeanBackend", "bfloat16")
    out = rollout.generate([GenerationRequest("run/0/p", tuple(PROMPTS[0]), 3, (0, 1, 2))],
                           SamplingContract(max_new_tokens=6), version)
    merged = merge_adapter(base16, state, adapter_scaling(model))
    assert all(merged[k].dtype == torch.bfloat16 for k in merged)
    held = _plain_model()[0].to(torch.bfloat16)
    held.load_state_dict(merged)
    lp, _, _ = response_log_probs(held, [list(s.prompt_ids) for s in out], [list(s.response_ids) for s in out])
    gap = max(float((torch.tensor(s.rollout_log_probs) - lp[i, :len(s.response_ids)].float()).abs().max())
              for i, s in enumerate(out))
    assert gap <= 0.25


def _hashes(model, tok):
    return tokenizer_hash(tok), model_config_hash(model.config)


class _Corrupting(Rollout):
    """A replica whose copy of one adapter tensor arrives flipped (a bad transfer)."""

    def stage(self, state, manifest):
        bad = dict(state)
        bad[NAME] = bad[NAME].clone()
        bad[NAME].view(-1)[0] += 1.0
        return super().stage(bad, manifest)


NAME = "model.layers.1.mlp.down_proj.lora_B"


def test_a_corrupted_adapter_tensor_activates_nothing_anywhere():
    model, tok = _peft()
    actor = _actor(model, tok)
    template = build_tiny_model(seed=0, **SMALL)[0]
    replicas = [Rollout(template, tok), _Corrupting(template, tok)]
    for r in replicas:
        r.pin_base(base_state(model), actor.base)
    pool = RolloutPool(LocalWorkerGroup("rollout", replicas))
    v0_state, v0 = actor.export()
    for r in replicas:   # v0 is held everywhere (replica 1 gets it uncorrupted)
        Rollout.load(r, v0_state, v0)
    with torch.no_grad():
        adapter_state(model)[NAME].add_(0.1)
    actor.step = 1
    state, v1 = actor.export()
    assert v1.version.weights_hash != v0.version.weights_hash
    with pytest.raises(Exception, match=f"{NAME}.*checksum"):
        pool.load(state, v1)
    assert [r.version for r in replicas] == [v0.version, v0.version]   # nobody switched
    assert [r.staged_version for r in replicas] == [None, None]


def test_exported_adapter_and_merged_folder_reload_to_the_same_log_probs(tmp_path):
    from peft import PeftModel
    model, tok = _saved_base_and_policy(tmp_path, lambda t: t.normal_(0, 0.2))
    model.eval()
    save_policy(model, tok, tmp_path / "run")
    want, _, _ = response_log_probs(model, PROMPTS, RESPONSES)
    adapter = PeftModel.from_pretrained(load_causal_lm(tmp_path / "base")[0], tmp_path / "run" / "adapter").eval()
    merged, _ = load_causal_lm(tmp_path / "run" / "model")   # plain transformers, no peft
    assert not has_lora(merged)
    base_lp, _, _ = response_log_probs(load_causal_lm(tmp_path / "base")[0], PROMPTS, RESPONSES)
    assert (want - base_lp).abs().max() > 1e-2   # the adapter is not a no-op
    for other in (adapter, merged):
        got, _, _ = response_log_probs(other, PROMPTS, RESPONSES)
        assert (got - want).abs().max() <= 1e-5


def test_optimizer_state_only_for_the_adapter():
    model, tok = _peft()
    actor = _actor(model, tok)
    # all-linear on 2 layers: q, k, v, o, gate, up, down = 7 layers x (A, B) each
    params = [p for g in actor.optimizer.param_groups for p in g["params"]]
    assert len(params) == 2 * 7 * 2
    loss = response_log_probs(model.train(), PROMPTS, RESPONSES)[0].sum()
    loss.backward()
    actor.optimizer.step()
    assert len(actor.optimizer.state) == 28
    assert all(p.requires_grad is False for n, p in model.named_parameters() if ".lora_" not in n)


def mid_shape() -> Qwen2ForCausalLM:
    """The benchmark's mid shape (benchmarks/lora.py): random-init Qwen2, GQA, tied embeddings."""
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=16384, hidden_size=512, intermediate_size=1152,
                                        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                                        tie_word_embeddings=True, max_position_embeddings=256))


def test_bytes_per_sync_with_lora_under_a_tenth_of_a_full_sync():
    tok = build_char_tokenizer()
    full_state, _ = _actor(mid_shape(), tok).export()   # what publish hands to the rollout
    # per layer: q 512^2, k, v 512 * 128 (+ biases 512 + 2 * 128), o 512^2, gate, up, down 512 * 1152,
    # two norms of 512; the final norm 512; the tied 16384 * 512 embedding once (embed_tokens and
    # lm_head are one copy in the export, as in the model)
    per_layer = 2 * 512 * 512 + 2 * 512 * 128 + (512 + 256) + 3 * 512 * 1152 + 2 * 512
    assert sync_bytes(full_state) == 4 * (16384 * 512 + 3 * per_layer + 512)   # the 15.67M parameters, once
    assert full_state["lm_head.weight"] is full_state["model.embed_tokens.weight"]
    state, _ = _actor(apply_lora(mid_shape(), LoraConfig(rank=16, alpha=32.0), "actor.lora", seed=0), tok).export()
    # rank 16 on every linear: r * (in + out) per layer
    per_layer_lora = 16 * (2 * (512 + 512) + 2 * (512 + 128) + 3 * (512 + 1152))
    assert sync_bytes(state) == 4 * 3 * per_layer_lora   # 2.5% of the full sync
    assert sync_bytes(state) < 0.1 * sync_bytes(full_state)


def test_copy_once_shares_a_tied_pair_and_never_two_empty_tensors():
    """Names of one tensor (a tied embedding and LM head) are copied (gathered, sent) once; two
    empty tensors of one shape are two, whatever address they report: with FSDP2 a rank's empty
    shards may share one, and aliasing them on that rank only would skip a collective there."""
    from sealrl.sync.adapter import copy_once
    tied, calls = torch.ones(3, 2), []
    out = copy_once({"embed": tied, "head": tied, "m1": torch.empty(0, 2), "m2": torch.empty(0, 2)},
                    lambda t: calls.append(t) or t.clone())
    assert len(calls) == 3 and out["embed"] is out["head"] and out["m1"] is not out["m2"]
