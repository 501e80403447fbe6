"""Chunked log-probs and entropy (models/chunked.py): equal to the naive full-logits formulas
(written out here), gradients included; the chunked graph keeps no (tokens, vocab) tensor."""
from __future__ import annotations

import pytest
import torch

from sealrl.models.chunked import chunked_log_probs, output_weight
from sealrl.models.logprobs import response_log_probs
from sealrl.models.packing import padded_chunked_log_probs
from sealrl.models.tiny import build_tiny_model

M, H, V = 13, 8, 50


def naive(hidden, weight, tokens, temperature):
    """log_softmax and entropy by their definitions, from the full (M, V) logits."""
    z = (hidden @ weight.t()) / temperature
    logp = z - torch.log(torch.exp(z - z.max(-1, keepdim=True).values).sum(-1, keepdim=True)) \
        - z.max(-1, keepdim=True).values
    p = torch.exp(logp)
    return logp.gather(-1, tokens[:, None])[:, 0], -(p * logp).sum(-1)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(M, H, generator=g) * 2).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).requires_grad_(True)
    tokens = torch.randint(0, V, (M,), generator=g)
    g_lp, g_ent = torch.randn(M, generator=g), torch.randn(M, generator=g)
    return hidden, weight, tokens, g_lp, g_ent


@pytest.mark.parametrize("chunk", [1, 4, M, M + 7])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_naive_with_gradients(chunk, temperature):
    hidden, weight, tokens, g_lp, g_ent = _inputs()
    lp_ref, ent_ref = naive(hidden, weight, tokens, temperature)
    gh_ref, gw_ref = torch.autograd.grad((lp_ref * g_lp + ent_ref * g_ent).sum(), (hidden, weight))
    lp, ent = chunked_log_probs(hidden, weight, tokens, temperature, chunk, with_entropy=True)
    gh, gw = torch.autograd.grad((lp * g_lp + ent * g_ent).sum(), (hidden, weight))
    assert (lp - lp_ref).abs().max() <= 1e-5 and (ent - ent_ref).abs().max() <= 1e-5
    for got, ref in ((gh, gh_ref), (gw, gw_ref)):  # fp32 rounding of sums of many products: relative
        assert (got - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))


def test_log_probs_only_and_hand_values():
    # two tokens, vocabulary 2, identity-like weight: logits are the hidden states themselves
    hidden = torch.tensor([[0.0, 0.0], [2.0, 0.0]], requires_grad=True)
    weight = torch.eye(2, requires_grad=True)
    lp, ent = chunked_log_probs(hidden, weight, torch.tensor([0, 1]), 1.0, chunk=1)
    assert ent is None
    e2 = torch.exp(torch.tensor(2.0))
    expected = torch.tensor([-torch.log(torch.tensor(2.0)), -torch.log1p(e2)])  # log 1/2, log 1/(1+e^2)
    assert torch.allclose(lp, expected, atol=1e-6)
    lp.sum().backward()
    # d lp / d z = onehot - p: row 0 p = (1/2, 1/2), token 0 -> (1/2, -1/2); row 1 p = (e^2, 1)/(1+e^2)
    p1 = torch.stack([e2, torch.tensor(1.0)]) / (1 + e2)
    assert torch.allclose(hidden.grad[0], torch.tensor([0.5, -0.5]), atol=1e-6)
    assert torch.allclose(hidden.grad[1], torch.tensor([0.0, 1.0]) - p1, atol=1e-6)


def _saved_bytes(fn) -> int:
    """Largest single tensor autograd saves for the backward while `fn` runs."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes)


def test_no_vocabulary_sized_tensor_is_kept_for_the_backward():
    hidden, weight, tokens, _, _ = _inputs()
    full = M * V * 4
    naive_max = _saved_bytes(lambda: naive(hidden, weight, tokens, 1.0))
    chunked_max = _saved_bytes(lambda: chunked_log_probs(hidden, weight, tokens, 1.0, 4, with_entropy=True))
    assert naive_max >= full
    assert chunked_max == V * H * 4  # the weight itself; per-token: hidden (M*H) and (M,) statistics


@pytest.mark.parametrize("chunk", [1, 5])
def test_model_path_equals_the_full_logits_path(chunk):
    model = build_tiny_model(seed=2)[0]
    prompts = [[11, 12, 14, 8], [5, 9], [20]]
    responses = [[4, 5, 2], [], [5, 6, 7, 8, 9, 10, 2]]
    lp0, ent0, mask0 = response_log_probs(model, prompts, responses, 0.8, with_entropy=True)
    (lp0.sum() + 0.5 * ent0.sum()).backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    lp1, ent1, mask1 = padded_chunked_log_probs(model, prompts, responses, 0.8, 0, True, chunk)
    (lp1.sum() + 0.5 * ent1.sum()).backward()
    assert torch.equal(mask0, mask1)
    assert (lp0 - lp1).abs().max() <= 1e-5 and (ent0 - ent1).abs().max() <= 1e-5
    for a, p in zip(g0, model.parameters()):
        assert (a - p.grad).abs().max() <= 1e-5 * max(1.0, float(a.abs().max()))


def test_bf16_autocast_runs_the_matmuls_in_bf16():
    hidden, weight, tokens, _, _ = _inputs()
    ref, _ = naive(hidden.detach().bfloat16().float(), weight.detach().bfloat16().float(), tokens, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_log_probs(hidden, weight, tokens, 1.0, 4)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert weight.grad.dtype == torch.float32  # the fp32 master weight gets an fp32 gradient
    # bf16 products summed in fp32 vs fp32 products of the bf16-rounded inputs: close, not equal
    assert (lp - ref).abs().max() <= 0.1


def test_a_head_that_is_not_a_plain_matmul_is_refused():
    model = build_tiny_model(seed=0)[0]
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        output_weight(model)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_kept_logits_give_the_recomputed_backward_bit_for_bit(temperature, entropy_grad):
    """keep_logits (actor.logit_chunk_keep) saves one matmul, not one bit: same values and
    gradients as the recomputing backward, and both equal the naive formulas."""
    hidden, weight, tokens, g_lp, g_ent = _inputs(3)
    lp_ref, ent_ref = naive(hidden, weight, tokens, temperature)
    loss_ref = (lp_ref * g_lp + (ent_ref * g_ent if entropy_grad else 0)).sum()
    grads_ref = torch.autograd.grad(loss_ref, (hidden, weight))
    grads = []
    for keep in (False, True):
        lp, ent = chunked_log_probs(hidden, weight, tokens, temperature, 4, with_entropy=True, keep_logits=keep)
        loss = (lp * g_lp + (ent * g_ent if entropy_grad else 0)).sum()
        grads.append(torch.autograd.grad(loss, (hidden, weight)))
    for a, b, ref in zip(*grads, grads_ref):
        assert torch.equal(a, b)
        assert (a - ref).abs().max() <= 1e-5 * max(1.0, float(ref.abs().max()))


@pytest.mark.parametrize("keep", [False, True])
def test_a_loss_of_one_output_only(keep):
    """Only the entropy (log-probs unused: their gradient is None) or only the log-probs (the
    entropy's is None, its terms skipped): the naive gradients either way."""
    hidden, weight, tokens, g_lp, g_ent = _inputs(5)
    lp_ref, ent_ref = naive(hidden, weight, tokens, 0.8)
    for pick in (0, 1):
        ref = torch.autograd.grad(((lp_ref * g_lp) if pick == 0 else (ent_ref * g_ent)).sum(), (hidden, weight),
                                  retain_graph=True)
        lp, ent = chunked_log_probs(hidden, weight, tokens, 0.8, 5, with_entropy=True, keep_logits=keep)
        got = torch.autograd.grad(((lp * g_lp) if pick == 0 else (ent * g_ent)).sum(), (hidden, weight))
        for a, b in zip(got, ref):
            assert (a - b).abs().max() <= 1e-5 * max(1.0, float(b.abs().max()))
