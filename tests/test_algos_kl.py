"""Golden values for sealrl.algos.kl, derived by hand in the comments."""
import json
import math

import pytest
import torch
from torch.testing import assert_close

from sealrl.algos import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty, shaped_token_rewards

t = torch.tensor

# log p - log q = [0.5, -1.0]
LOGP = [[-1.0, -2.0]]
REF = [[-1.5, -1.0]]
E = math.e


@pytest.mark.parametrize("kind, want", [
    ("k1", [[0.5, -1.0]]),                              # log p - log q
    ("abs", [[0.5, 1.0]]),
    ("k2", [[0.125, 0.5]]),                             # 0.5 * 0.25, 0.5 * 1
    # log r = log q - log p = [-0.5, 1]: e^-0.5 + 0.5 - 1 = 0.1065307, e - 1 - 1 = 0.7182818
    ("k3", [[math.exp(-0.5) - 0.5, E - 2]]),
])
def test_estimators_golden(kind, want):
    assert_close(kl_penalty(t(LOGP), t(REF), kind), t(want))


def test_k3_clamps():
    logp = t([[0.0, 0.0]], requires_grad=True)
    ref = t([[30.0, -30.0]])
    # log r = +30 -> clamped to 20: e^20 - 21 = 4.85e8 -> clamped to 10
    # log r = -30 -> clamped to -20: e^-20 + 20 - 1 = 19.0 -> clamped to 10
    kl = kl_penalty(logp, ref, "k3")
    assert_close(kl, t([[10.0, 10.0]]))
    kl.sum().backward()
    assert_close(logp.grad, t([[0.0, 0.0]]))  # both clamps bite: no gradient, never inf


@pytest.mark.parametrize("kind, value", [
    ("k1+", [[0.5, -1.0]]),
    ("k3+", [[math.exp(-0.5) - 0.5, E - 2]]),
    ("abs+", [[0.5, 1.0]]),
])
def test_straight_through_value_of_kx_gradient_of_k2(kind, value):
    logp = t(LOGP, requires_grad=True)
    ref = t(REF, requires_grad=True)
    kl = kl_penalty(logp, ref, kind)
    assert_close(kl, t(value))
    kl.sum().backward()
    # d k2 / d log p = log p - log q = [0.5, -1]; d / d log q = -(log p - log q)
    assert_close(logp.grad, t([[0.5, -1.0]]))
    assert_close(ref.grad, t([[-0.5, 1.0]]))


def test_registry_and_unknown_kind():
    assert set(KL_ESTIMATORS) == {"k1", "abs", "k2", "k3", "k1+", "k3+", "abs+"}
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(t(LOGP), t(REF), "k4")


def test_shaped_token_rewards_golden():
    scores = t([2.0, 5.0, 7.0])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    r = shaped_token_rewards(scores, kl, mask, beta=0.5)
    # row 0: -0.05, -0.1 + 2 = 1.9, padding 0
    # row 1: -0.2, -0.25, -0.3 + 5 = 4.7
    # row 2: all masked -> zeros (the score 7 has no token to sit on)
    assert_close(r, t([[-0.05, 1.9, 0.0], [-0.2, -0.25, 4.7], [0.0, 0.0, 0.0]]))


def test_shaped_token_rewards_last_token_after_a_hole():
    # last valid token of [1, 0, 1, 0] is index 2, not 0
    r = shaped_token_rewards(t([3.0]), torch.zeros(1, 4), t([[1, 0, 1, 0]]), beta=0.1)
    assert_close(r, t([[0.0, 0.0, 3.0, 0.0]]))


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(current_kl=100.0, n_steps=1000)
    assert c.beta == 0.05
    state = json.loads(json.dumps(c.state_dict()))
    d = FixedKLController(1.0)
    d.load_state_dict(state)
    assert d.beta == 0.05
    with pytest.raises(ValueError):
        FixedKLController(-1.0)


def test_adaptive_controller_golden_and_state():
    c = AdaptiveKLController(init_beta=0.1, target=6.0, horizon=10000)
    c.update(current_kl=9.0, n_steps=256)
    # error = 9/6 - 1 = 0.5 -> clipped to 0.2; beta = 0.1 * (1 + 0.2 * 256/10000) = 0.100512
    assert c.beta == pytest.approx(0.100512)
    c.update(current_kl=t(5.4), n_steps=1000)
    # error = 5.4/6 - 1 = -0.1; beta = 0.100512 * (1 - 0.1 * 0.1) = 0.09950688
    assert c.beta == pytest.approx(0.09950688)
    state = json.loads(json.dumps(c.state_dict()))  # plain JSON round trip
    d = AdaptiveKLController(init_beta=1.0, target=1.0, horizon=1.0)
    d.load_state_dict(state)
    assert (d.beta, d.target, d.horizon) == (c.beta, 6.0, 10000.0)
    with pytest.raises(ValueError, match="adaptive"):
        d.load_state_dict(FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_adaptive_controller_never_leaves_zero_to_inf():
    """kl_coef 0.05, target 1e-4, horizon 2, batches of 256 samples: the paper's factor
    1 + e * 256 / 2 is 1 - 0.2 * 128 = -24.6 at the first step (KL 0 < target), and beta went
    0.05, -1.23, -32.7, -870. The step e * n / horizon is clipped to [-0.2, 0.2]."""
    c = AdaptiveKLController(init_beta=0.05, target=1e-4, horizon=2)
    betas = [c.beta]
    for kl in (0.0, 0.5, 0.5, 0.0, 1e-4):
        c.update(current_kl=kl, n_steps=256)
        betas.append(c.beta)
    # KL 0: e = -1 -> -0.2, step -25.6 -> -0.2: 0.05 * 0.8 = 0.04
    # KL 0.5: e = 4999 -> 0.2, step 25.6 -> 0.2: 0.048, then 0.0576
    # KL 0: 0.0576 * 0.8 = 0.04608;  KL = target: e = 0, beta unchanged
    assert betas == pytest.approx([0.05, 0.04, 0.048, 0.0576, 0.04608, 0.04608])
    assert all(b >= 0 for b in betas)


def test_adaptive_step_is_the_papers_while_the_batch_is_within_the_horizon():
    c = AdaptiveKLController(init_beta=1.0, target=1.0, horizon=100)
    c.update(current_kl=0.0, n_steps=100)   # e = -0.2, step -0.2 * 100/100 = -0.2 (the clip's edge)
    assert c.beta == pytest.approx(0.8)
