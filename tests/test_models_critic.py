"""Critic: values at the positions that chose each action, the bootstrap value, save/load."""
from __future__ import annotations

import pytest
import torch

from sealrl.models.critic import VALUE_HEAD_FILE, CriticModel
from sealrl.models.hf import save_causal_lm
from sealrl.models.tiny import build_tiny_model

PROMPTS = [[11, 12, 14, 8, 6, 18], [5, 9], [20, 21, 22]]
RESPONSES = [[4, 5, 2], [7, 8, 9, 10, 11], []]



@pytest.fixture(scope="module")
def lm():
    return build_tiny_model(seed=2, hidden_size=32, num_layers=2, intermediate_size=64)


@pytest.fixture(scope="module")
def critic(lm):
    torch.manual_seed(0)
    return CriticModel.from_causal_lm(lm[0]).eval()


def test_shapes_and_mask(critic):
    with torch.no_grad():
        values, last, mask = critic.values(PROMPTS, RESPONSES)
    assert values.shape == (3, 5) and last.shape == (3,) and mask.shape == (3, 5)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert (values[mask == 0] == 0).all()


def test_values_match_a_manual_per_sequence_computation(critic):
    """V(s_j) = head(hidden at the position that predicts response token j), computed here on
    each sequence alone (no padding) with the backbone and head called by hand."""
    with torch.no_grad():
        values, last, _ = critic.values(PROMPTS, RESPONSES)
        for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
            hidden = critic.backbone(torch.tensor([p + r])).last_hidden_state[0]  # (T, H)
            w, bias = critic.value_head.weight[0], critic.value_head.bias[0]
            manual = hidden @ w + bias  # (T,)
            for j in range(len(r)):
                assert abs(values[b, j].item() - manual[len(p) - 1 + j].item()) <= 1e-5
            assert abs(last[b].item() - manual[len(p) + len(r) - 1].item()) <= 1e-5


def test_backbone_is_the_causal_lm_base_model(lm, critic):
    model, _ = lm
    assert torch.equal(critic.backbone.embed_tokens.weight, model.model.embed_tokens.weight)
    assert critic.backbone.embed_tokens.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_save_load_round_trip_is_identical(critic, tmp_path):
    folder = critic.save(tmp_path / "critic")
    assert (folder / VALUE_HEAD_FILE).is_file() and (folder / "model.safetensors").is_file()
    loaded = CriticModel.from_pretrained(folder).eval()
    with torch.no_grad():
        a = critic.values(PROMPTS, RESPONSES)
        b = loaded.values(PROMPTS, RESPONSES)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_from_a_causal_lm_folder_starts_a_new_head(lm, tmp_path):
    model, tokenizer = lm
    folder = save_causal_lm(model, tokenizer, tmp_path / "lm")
    critic = CriticModel.from_pretrained(folder)
    assert torch.equal(critic.backbone.layers[0].mlp.up_proj.weight,
                       model.model.layers[0].mlp.up_proj.weight)
    assert critic.value_head.weight.shape == (1, model.config.hidden_size)


def test_from_config_is_deterministic_and_trains(lm):
    a = CriticModel.from_config(lm[0].config, seed=5)
    b = CriticModel.from_config(lm[0].config, seed=5)
    assert torch.equal(a.value_head.weight, b.value_head.weight)
    values, last, mask = a.values(PROMPTS, RESPONSES)
    ((values - 1.0).pow(2).sum() / mask.sum() + last.pow(2).mean()).backward()
    assert a.value_head.weight.grad.abs().sum() > 0
    assert a.backbone.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
