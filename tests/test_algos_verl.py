"""Golden values for the estimators and losses verl users select (sealrl.algos.baselines and
.surrogates), each derived by hand in the comments: nothing here calls the function under test
to produce its expectation."""
import math

import pytest
import torch
from torch.testing import assert_close

from sealrl import algos as A

t = torch.tensor


def test_remax_subtracts_the_greedy_reward_from_the_return():
    # row 0: score 1 on its last token (t=2), KL-shaped -0.1 at t=0; greedy baseline 0.5
    #   G = 0.9, 1.0, 1.0 -> A = 0.4, 0.5, 0.5
    # row 1: 2 tokens and a hole at t=1 (mask 0, its 7 is ignored), score 0 at t=2; baseline 0.5
    #   G = 0, (hole), 0 -> A = -0.5, 0, -0.5;  row 2 padding-only after t=0: G = 3 -> A = 3 - 1 = 2
    rewards = t([[-0.1, 0.0, 1.0], [0.0, 7.0, 0.0], [3.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 1], [1, 0, 0]])
    adv = A.remax_advantages(rewards, t([0.5, 0.5, 1.0]), mask)
    assert_close(adv, t([[0.4, 0.5, 0.5], [-0.5, 0.0, -0.5], [2.0, 0.0, 0.0]]))


def test_opo_length_weighted_baseline():
    # group 0 (rows 0, 2, 5): scores 1, 0, 1, lengths 2, 4, 6 -> b = (2 + 0 + 6) / 12 = 2/3
    # group 1 (row 3): one member -> 0
    # group 2 (rows 1, 4): scores 2, 4, lengths 1, 3 -> b = (2 + 12) / 4 = 3.5
    scores = t([1.0, 2.0, 0.0, 5.0, 4.0, 1.0])
    groups = t([0, 2, 0, 1, 2, 0])
    lengths = t([2, 1, 4, 7, 3, 6])
    assert_close(A.opo_advantages(scores, groups, lengths), t([1 / 3, -1.5, -2 / 3, 0.0, 0.5, 1 / 3]))
    # every response empty: the plain mean (2 + 4) / 2 = 3
    assert_close(A.opo_advantages(t([2.0, 4.0]), t([0, 0]), t([0, 0])), t([-1.0, 1.0]))


def test_gpg_alpha_scales_by_nonzero_share():
    # B = 6, nonzero scores 1, 1, 2 -> alpha = 6 / 3 = 2
    # group 7 (rows 0-2): mean 2/3 -> 2 (1 - 2/3) = 2/3, 2 (0 - 2/3) = -4/3, 2/3
    # group 3 (rows 3-4): mean 0 -> 0, 0; group 9 (row 5): one member -> 0
    scores = t([1.0, 0.0, 1.0, 0.0, 0.0, 2.0])
    groups = t([7, 7, 7, 3, 3, 9])
    assert_close(A.gpg_advantages(scores, groups), t([2 / 3, -4 / 3, 2 / 3, 0.0, 0.0, 0.0]))
    # f_norm = 2 halves it
    assert_close(A.gpg_advantages(scores, groups, f_norm=2.0), t([1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0]))
    # nothing rewarded: alpha = 6 / max(1, 0) = 6, all advantages 0 anyway
    assert_close(A.gpg_advantages(torch.zeros(6), groups), torch.zeros(6))


def test_passk_credits_only_the_best_by_its_margin():
    # group 0 (rows 0-3): 0.5, 1.0, 0.2, 1.0 -> best 1.0 tied with the runner-up: margin 0
    # group 1 (rows 4-6): 3, 1, 2 -> best row 4, runner-up 2, margin 1; mean 2,
    #   unbiased var (1 + 1 + 0) / 2 = 1, std 1 -> adv = 1 / (1 + 1e-6)
    # group 2 (row 7): one member -> 0
    scores = t([0.5, 1.0, 0.2, 1.0, 3.0, 1.0, 2.0, 4.0])
    groups = t([0, 0, 0, 0, 1, 1, 1, 2])
    want = torch.zeros(8)
    want[4] = 1 / (1 + 1e-6)
    assert_close(A.passk_advantages(scores, groups), want)
    want[4] = 1.0
    assert_close(A.passk_advantages(scores, groups, norm_by_std=False), want)
    # interleaved: group 5 = rows 0, 2 (scores 1, 4), group 6 = rows 1, 3 (scores 7, 7)
    # group 5: best row 2, margin 3, std = sqrt(((1-2.5)^2 + (4-2.5)^2) / 1) = sqrt(4.5)
    got = A.passk_advantages(t([1.0, 7.0, 4.0, 7.0]), t([5, 6, 5, 6]))
    assert_close(got, t([0.0, 0.0, 3 / (math.sqrt(4.5) + 1e-6), 0.0]))


def test_sum_pi_squared_from_logits():
    # softmax([0, log 3]) = [1/4, 3/4] -> 1/16 + 9/16 = 0.625
    assert_close(A.sum_pi_squared_from_logits(t([[0.0, math.log(3.0)]])), t([0.625]))


def _otb_inputs():
    # one group of two rows, T = 3; row 0 is 3 tokens with score 1 on its last, row 1 is 2
    # tokens with score 0; row 2 is a group of its own
    rewards = t([[0.0, 0.0, 1.0], [0.0, 0.0, 9.0], [0.0, 2.0, 0.0]])   # 9 sits on padding
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    groups = t([4, 4, 8])
    # pi = 0.5 and sum pi^2 = 0.5 in row 0; pi = 0.25 and sum pi^2 = 0.25 in row 1
    old = t([[0.5] * 3, [0.25] * 3, [0.5] * 3]).log()
    sq = t([[0.5] * 3, [0.25] * 3, [0.5] * 3])
    return rewards, mask, groups, old, sq


def test_optimal_token_baseline_golden():
    rewards, mask, groups, old, sq = _otb_inputs()
    # w row 0 = 1 - 2 (0.5) + 0.5 = 0.5 -> W = 0.5, 1.0, 1.5; G = 1, 1, 1
    # w row 1 = 1 - 2 (0.25) + 0.25 = 0.75 -> W = 0.75, 1.5; G = 0, 0
    # B_0 = (1 * 0.5 + 0 * 0.75) / (0.5 + 0.75) = 0.4;  B_1 = (1 * 1.0) / (1.0 + 1.5) = 0.4
    # B_2 = (1 * 1.5) / 1.5 = 1 (row 0 alone; eps 1e-8 is below float32's resolution here)
    # row 2 is alone in its group: 0
    adv = A.optimal_token_baseline_advantages(rewards, mask, groups, old, sq, handle_zero_tail=False)
    assert_close(adv, t([[0.6, 0.6, 0.0], [-0.4, -0.4, 0.0], [0.0, 0.0, 0.0]]))
    # zero tail: row 0 is the unique longest (3 > 2), so its baseline from position 2 on is 0: A = G = 1
    adv = A.optimal_token_baseline_advantages(rewards, mask, groups, old, sq)
    assert_close(adv, t([[0.6, 0.6, 1.0], [-0.4, -0.4, 0.0], [0.0, 0.0, 0.0]]))


def test_optimal_token_baseline_is_weights_square_into_w():
    rewards, mask, groups, old, sq = _otb_inputs()
    # IS weight 2 on row 1: w = 0.75 * 4 = 3 -> W = 3, 6; row 0 unchanged (weight 1)
    # B_0 = 0.5 / (0.5 + 3) = 1/7;  B_1 = 1.0 / (1.0 + 6) = 1/7
    isw = t([[1.0] * 3, [2.0] * 3, [1.0] * 3])
    adv = A.optimal_token_baseline_advantages(rewards, mask, groups, old, sq, is_weights=isw,
                                              handle_zero_tail=False)
    assert_close(adv, t([[6 / 7, 6 / 7, 0.0], [-1 / 7, -1 / 7, 0.0], [0.0, 0.0, 0.0]]))


def _norm(mask, mode="token-mean"):
    return A.make_normaliser(mask, mode)


def test_sapo_gate_value_and_gradient():
    # tokens: r = 1 with A = 1 (tau_pos = 1), r = 2 with A = -1 (tau_neg = 2)
    # f0 = (4/1) sigmoid(0) = 2 -> l0 = -2;  f1 = (4/2) sigmoid(2 (2 - 1)) = 2 s, s = sigmoid(2)
    # l1 = -f1 * (-1) = 2 s; token-mean = (-2 + 2 s) / 2 = s - 1
    # d l / d log_prob = -A * 4 sig (1 - sig) * r:  token 0: -1 * 4 * 1/4 * 1 = -1;
    # token 1: 1 * 4 s (1 - s) * 2 = 8 s (1 - s); both / 2 (token-mean)
    s = 1 / (1 + math.exp(-2.0))
    lp = t([[0.0, math.log(2.0)]], requires_grad=True)
    mask = t([[1, 1]])
    loss, metrics = A.sapo_loss(lp, torch.zeros(1, 2), t([[1.0, -1.0]]), mask, _norm(mask),
                                tau_pos=1.0, tau_neg=2.0)
    assert_close(loss, t(s - 1))
    loss.backward()
    assert_close(lp.grad, t([[-0.5, 4 * s * (1 - s)]]))
    assert_close(metrics["ratio_mean"], t(1.5))


def test_cispo_detached_clipped_weight():
    # r = 1.5, 0.5, 1.1 with A = 2, -1, 1 and clip 0.2 / 0.2 -> w = 1.2, 0.8, 1.1
    # l = -w A log_prob = -2.4 log 1.5, 0.8 log 0.5, -1.1 log 1.1; token-mean over 3
    # gradient -w A / 3 = -2.4/3, 0.8/3, -1.1/3 (the weight is detached: clipped tokens still learn)
    r = t([[1.5, 0.5, 1.1, 7.0]])
    lp = r.log().clone().requires_grad_()
    mask = t([[1, 1, 1, 0]])
    loss, metrics = A.cispo_loss(lp, torch.zeros(1, 4), t([[2.0, -1.0, 1.0, 5.0]]), mask, _norm(mask))
    want = (-2.4 * math.log(1.5) + 0.8 * math.log(0.5) - 1.1 * math.log(1.1)) / 3
    assert_close(loss, t(want))
    loss.backward()
    assert_close(lp.grad, t([[-2.4 / 3, 0.8 / 3, -1.1 / 3, 0.0]]))
    assert_close(metrics["clip_frac_upper"], t(1 / 3))
    assert_close(metrics["clip_frac_lower"], t(1 / 3))


def test_gmpo_geometric_mean_with_sign_aware_log_clip():
    # row 0: A = 1 on 2 tokens, x = 0.5, -0.1; A > 0 clips only above: c = 0.4, -0.1
    #   rho = exp(0.3 / 2) = e^0.15, l0 = -e^0.15
    # row 1: A = -2 on 3 tokens, x = -0.6, 0.2, 0.0; A < 0 clips only below: c = -0.4, 0.2, 0.0
    #   rho = exp(-0.2 / 3), l1 = 2 e^(-1/15)
    # seq-mean-token-mean: (l0 + l1) / 2
    # gradient: row 0 token 0 clipped -> 0; token 1: -A rho (1/2) / 2 = -e^0.15 / 4
    #           row 1 token 0 clipped -> 0; tokens 1, 2: 2 rho (1/3) / 2 = e^(-1/15) / 3
    x = t([[0.5, -0.1, 0.0], [-0.6, 0.2, 0.0]])
    lp = x.clone().requires_grad_()
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv = t([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    loss, metrics = A.gmpo_loss(lp, torch.zeros(2, 3), adv, mask, _norm(mask, "seq-mean-token-mean"))
    assert_close(loss, t((-math.exp(0.15) + 2 * math.exp(-1 / 15)) / 2))
    loss.backward()
    assert_close(lp.grad, t([[0.0, -math.exp(0.15) / 4, 0.0], [0.0, math.exp(-1 / 15) / 3, math.exp(-1 / 15) / 3]]))
    assert_close(metrics["clip_frac_upper"], t(0.2))    # row 0 token 0, of 5 valid tokens
    assert_close(metrics["clip_frac_lower"], t(0.2))    # row 1 token 0


def _cov_inputs():
    # A: row 0 = 3, 3; row 1 = -1, -1 -> mean A = 1
    # log_prob: row 0 = -1, -3; row 1 = -2, -2 -> mean -2
    # cov = (2)(1) = 2, (2)(-1) = -2, (-2)(0) = 0, 0
    adv = t([[3.0, 3.0], [-1.0, -1.0]])
    lp = t([[-1.0, -3.0], [-2.0, -2.0]])
    return adv, lp, t([[1, 1], [1, 1]])


def test_clip_cov_cuts_the_high_covariance_token():
    adv, lp0, mask = _cov_inputs()
    # ratio 1 everywhere (old = log_prob): no PPO clip; candidates with 1 < cov < 5: row 0 token 0
    # only; k = max(1, floor(2e-4 * 4)) = 1 -> that token's loss is 0
    # l = -A r = [0 (cut), -3, 1, 1], token-mean = -1/4; gradient -A / 4 with 0 on the cut token
    lp = lp0.clone().requires_grad_()
    g = torch.Generator().manual_seed(0)
    loss, metrics = A.clip_cov_loss(lp, lp0, adv, mask, _norm(mask), generator=g)
    assert_close(loss, t(-0.25))
    loss.backward()
    assert_close(lp.grad, t([[0.0, -0.75], [0.25, 0.25]]))
    assert_close(metrics["cov_clip_frac"], t(0.25))
    # a token PPO already clips is no candidate: r = 1.5 > 1.2 with A > 0 on row 0 token 0
    # -> nothing cut; l = -3 * 1.2, -3, 1, 1 -> (-3.6 - 3 + 2) / 4 = -1.15
    old = lp0.clone()
    old[0, 0] -= math.log(1.5)
    loss, metrics = A.clip_cov_loss(lp0.clone(), old, adv, mask, _norm(mask), generator=g)
    assert_close(loss, t(-1.15))
    assert_close(metrics["cov_clip_frac"], t(0.0))


def test_kl_cov_penalises_the_top_covariance_token():
    adv, lp0, mask = _cov_inputs()
    # x = log_prob - old = 0.2 on row 0 token 0, 0 elsewhere; top-1 covariance: row 0 token 0 (2)
    # l = -3 e^0.2 + 1 * |0.2|, -3, 1, 1 -> token-mean (-3 e^0.2 + 0.2 - 1) / 4
    # gradient at row 0 token 0: (-3 e^0.2 + 1) / 4; elsewhere -A / 4
    old = lp0.clone()
    old[0, 0] -= 0.2
    lp = lp0.clone().requires_grad_()
    loss, metrics = A.kl_cov_loss(lp, old, adv, mask, _norm(mask))
    assert_close(loss, t((-3 * math.exp(0.2) + 0.2 - 1) / 4))
    loss.backward()
    assert_close(lp.grad, t([[(-3 * math.exp(0.2) + 1) / 4, -0.75], [0.25, 0.25]]))
    assert_close(metrics["kl_cov_frac"], t(0.25))


def test_every_new_name_is_in_the_option_tables():
    assert {"remax", "opo", "gpg", "grpo_passk", "optimal_token_baseline"} <= set(A.ADVANTAGE_ESTIMATORS)
    assert {"sapo", "cispo", "gmpo", "clip_cov", "kl_cov"} <= set(A.POLICY_LOSSES)


@pytest.mark.parametrize("bad", [dict(tau_pos=0.0), dict(tau_neg=-1.0)])
def test_sapo_refuses_non_positive_temperatures(bad):
    mask = t([[1]])
    with pytest.raises(ValueError, match="tau"):
        A.sapo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), mask, _norm(mask), **bad)
