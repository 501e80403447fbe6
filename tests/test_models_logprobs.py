"""Teacher-forced log-probs: layout (token contract), padded batch == one-by-one, gradients."""
from __future__ import annotations

import pytest
import torch

from sealrl.models.logprobs import pad_batch, response_log_probs, response_window, token_entropy
from sealrl.models.tiny import build_tiny_model

PROMPTS = [[11, 12, 14, 8, 6, 18], [5, 9], [1, 7, 7, 7, 7, 7, 7, 3], [20]]
RESPONSES = [[4, 5, 2], [7], [], [5, 6, 7, 8, 9, 10, 2]]



@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=1)[0]


def reference_one_by_one(model, prompts, responses, temperature):
    """Each sequence alone, no padding: the plain definition of the log-prob of a response."""
    out = []
    for p, r in zip(prompts, responses):
        if not r:
            out.append(torch.zeros(0))
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1]  # (R, V)
        out.append(torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return out


def test_padded_layout_is_the_token_contract():
    batch = pad_batch(PROMPTS, RESPONSES, pad_id=0)
    P, R = batch.prompt_width, batch.response_width
    assert (P, R) == (8, 7)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        real = batch.input_ids[b][batch.attention_mask[b].bool()].tolist()
        assert real == p + r  # exactly the executed tokens, in order
        assert batch.input_ids[b, P - len(p):P].tolist() == p  # prompt ends at column P-1
        mask = batch.response_mask[b].tolist()
        assert mask == [1.0] * len(r) + [0.0] * (R - len(r))
        if r:  # the first response-mask 1 is the first sampled token
            assert batch.response_ids[b, 0].item() == r[0] == batch.input_ids[b, P].item()
        positions = batch.position_ids[b, P - len(p):P + len(r)].tolist()
        assert positions == list(range(len(p) + len(r)))


def test_response_window_selects_the_predicting_positions():
    batch = pad_batch(PROMPTS, RESPONSES)
    columns = torch.arange(batch.input_ids.shape[1]).expand(len(PROMPTS), -1)
    window = response_window(columns, batch, extra=1)
    # column j of the window predicts response token j; the extra column is after the last.
    assert window[0].tolist() == list(range(7, 15))
    assert (batch.input_ids.gather(1, window[:, :-1] + 1) == batch.response_ids).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_batch_matches_the_one_by_one_reference(model, temperature):
    with torch.no_grad():
        lp, ent, mask = response_log_probs(model, PROMPTS, RESPONSES, temperature, with_entropy=True)
    reference = reference_one_by_one(model, PROMPTS, RESPONSES, temperature)
    for b, ref in enumerate(reference):
        n = len(ref)
        if n:
            assert (lp[b, :n] - ref).abs().max() <= 1e-5
        assert (lp[b, n:] == 0).all() and (ent[b, n:] == 0).all()
    assert mask.sum() == sum(map(len, RESPONSES))


def test_entropy_is_the_entropy_of_the_tempered_distribution():
    logits = torch.randn(3, 5, 11)
    p = torch.softmax(logits / 0.5, -1)
    assert torch.allclose(token_entropy(logits, 0.5), -(p * p.log()).sum(-1), atol=1e-6)


def test_gradients_flow_and_are_finite(model):
    model.zero_grad()
    lp, _, mask = response_log_probs(model, PROMPTS, RESPONSES)
    (lp.sum() / mask.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_empty_prompt_is_refused(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        response_log_probs(model, [[1], []], [[2], [3]])
