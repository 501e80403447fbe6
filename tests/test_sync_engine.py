"""A rollout replica serves exactly one verified version: staging, verification, atomic swap."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest, VersionNotHeldError
from sealrl.models.hf import TokenizerMismatchError, model_config_hash, tokenizer_hash
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout import RolloutEngine
from sealrl.sync.manifest import WeightSyncError, build_manifest


@pytest.fixture()
def setup():
    model, tokenizer = build_tiny_model(seed=0, hidden_size=32, num_layers=2, intermediate_size=64)
    hashes = tokenizer_hash(tokenizer), model_config_hash(model.config)
    v0 = build_manifest(model.state_dict(), "run", 0, 0, *hashes)
    engine = RolloutEngine(model, tokenizer)
    engine.load_weights(model.state_dict(), v0)
    return model, tokenizer, engine, v0, hashes


REQUEST = [GenerationRequest("run/0/p", (11, 12, 14, 8, 6, 18), seed=3, candidates=(0, 1))]
CONTRACT = SamplingContract(max_new_tokens=6)


def next_weights(model):
    return {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}


def test_nothing_is_served_before_a_verified_load():
    model, tokenizer = build_tiny_model(seed=0, hidden_size=32, num_layers=2, intermediate_size=64)
    engine = RolloutEngine(model, tokenizer)
    assert engine.active_version is None
    v0 = build_manifest(model.state_dict(), "run", 0, 0, "", "").version
    with pytest.raises(VersionNotHeldError, match="holds nothing"):
        engine.generate(REQUEST, CONTRACT, v0)


def test_a_version_the_replica_does_not_hold_is_refused(setup):
    model, _, engine, v0, hashes = setup
    v1 = build_manifest(next_weights(model), "run", 1, 0, *hashes).version
    with pytest.raises(VersionNotHeldError, match="run@1.0"):
        engine.generate(REQUEST, CONTRACT, v1)
    retried = dataclasses.replace(v0.version, attempt=1)  # same step, another attempt
    with pytest.raises(VersionNotHeldError):
        engine.generate(REQUEST, CONTRACT, retried)
    assert engine.generate(REQUEST, CONTRACT, v0.version)[0].policy_version == v0.version


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_bad_weights_activate_nothing_and_the_old_version_keeps_serving(setup, damage):
    model, _, engine, v0, hashes = setup
    before = engine.generate(REQUEST, CONTRACT, v0.version)
    weights = next_weights(model)
    v1 = build_manifest(weights, "run", 1, 0, *hashes)
    name = "model.layers.1.mlp.down_proj.weight"
    sent = dict(weights)
    if damage == "corrupt":
        sent[name] = sent[name].clone()
        sent[name][3, 7] += 1e-3
    else:
        del sent[name]
    with pytest.raises(WeightSyncError, match=name) as info:
        engine.load_weights(sent, v1)
    assert info.value.tensor == name
    assert engine.active_version == v0.version
    with pytest.raises(VersionNotHeldError):
        engine.generate(REQUEST, CONTRACT, v1.version)
    after = engine.generate(REQUEST, CONTRACT, v0.version)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]


def test_swap_serves_the_new_version_only(setup):
    model, _, engine, v0, hashes = setup
    weights = next_weights(model)
    v1 = build_manifest(weights, "run", 1, 0, *hashes)
    engine.load_weights(weights, v1)
    assert engine.active_version == v1.version
    with pytest.raises(VersionNotHeldError):
        engine.generate(REQUEST, CONTRACT, v0.version)
    assert all(s.policy_version == v1.version
               for s in engine.generate(REQUEST, CONTRACT, v1.version))


def test_the_engine_keeps_its_own_copy(setup):
    model, _, engine, v0, _ = setup
    before = engine.generate(REQUEST, CONTRACT, v0.version)
    with torch.no_grad():  # the actor updates its weights in place after the sync
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    after = engine.generate(REQUEST, CONTRACT, v0.version)
    assert [s.rollout_log_probs for s in after] == [s.rollout_log_probs for s in before]


def test_a_manifest_for_another_tokenizer_or_architecture_is_refused(setup):
    model, _, engine, v0, (tok_hash, cfg_hash) = setup
    with pytest.raises(TokenizerMismatchError):
        engine.load_weights(model.state_dict(),
                            build_manifest(model.state_dict(), "run", 1, 0, "x" * 64, cfg_hash))
    with pytest.raises(WeightSyncError, match="another architecture"):
        engine.load_weights(model.state_dict(),
                            build_manifest(model.state_dict(), "run", 1, 0, tok_hash, "y" * 64))
    assert engine.active_version == v0.version


def test_weights_of_another_shape_are_refused_even_with_a_matching_manifest(setup):
    _, _, engine, v0, _ = setup
    other, _ = build_tiny_model(seed=0, hidden_size=48, num_layers=2, intermediate_size=64)
    manifest = build_manifest(other.state_dict(), "run", 1, 0, "", "")  # hashes left blank
    with pytest.raises(WeightSyncError, match="shape"):
        engine.load_weights(other.state_dict(), manifest)
    assert engine.active_version == v0.version
