"""Golden values for sealrl.algos.advantages, derived by hand in the comments."""
import math

import pytest
import torch
from torch.testing import assert_close

from sealrl.algos import (
    broadcast_to_tokens,
    gae,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    whiten,
)

t = torch.tensor


def test_broadcast_to_tokens():
    adv = t([2.0, -1.0, 5.0])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert_close(broadcast_to_tokens(adv, mask), t([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_whiten_golden():
    x = t([[1.0, 2.0, 3.0, 100.0]])
    mask = t([[1, 1, 1, 0]])
    # mu = (1+2+3)/3 = 2, var = (1 + 0 + 1)/3 = 2/3 (population), 1/sqrt(2/3) = 1.2247449
    s = 1 / math.sqrt(2 / 3)
    assert_close(whiten(x, mask), t([[-s, 0.0, s, 0.0]]))
    # shift_mean=False adds mu back: [2 - 1.2247, 2, 2 + 1.2247], padding still 0
    assert_close(whiten(x, mask, shift_mean=False), t([[2 - s, 2.0, 2 + s, 0.0]]))


def test_whiten_empty_and_single():
    x = t([[4.0, 7.0]])
    assert_close(whiten(x, t([[0, 0]])), t([[0.0, 0.0]]))          # nothing valid -> zeros
    assert_close(whiten(x, t([[0, 1]])), t([[0.0, 0.0]]))          # one token: x - mu = 0
    assert_close(whiten(x, t([[0, 1]]), shift_mean=False), t([[0.0, 7.0]]))


def test_gae_golden_terminated_and_truncated():
    # gamma = 0.9, lam = 0.8, gamma*lam = 0.72
    rewards = t([[0.0, 0.0, 1.0, 5.0], [0.0, 2.0, 9.0, 9.0]])
    values = t([[1.0, 2.0, 3.0, 99.0], [0.5, 0.5, 7.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    terminated = t([True, False])
    last_values = t([123.0, 4.0])  # row 0 terminated: its 123 must be ignored
    adv, ret = gae(rewards, values, mask, terminated, last_values, gamma=0.9, lam=0.8)
    # row 0 (terminated, next value after t=2 is 0):
    #   t=2: delta = 1 + 0.9*0 - 3 = -2                      A = -2
    #   t=1: delta = 0 + 0.9*3 - 2 = 0.7                     A = 0.7 + 0.72*(-2) = -0.74
    #   t=0: delta = 0 + 0.9*2 - 1 = 0.8                     A = 0.8 + 0.72*(-0.74) = 0.2672
    # row 1 (truncated, bootstrap V = 4 after t=1):
    #   t=1: delta = 2 + 0.9*4 - 0.5 = 5.1                   A = 5.1
    #   t=0: delta = 0 + 0.9*0.5 - 0.5 = -0.05               A = -0.05 + 0.72*5.1 = 3.622
    assert_close(adv, t([[0.2672, -0.74, -2.0, 0.0], [3.622, 5.1, 0.0, 0.0]]))
    # returns = A + V on valid tokens, 0 at padding
    assert_close(ret, t([[1.2672, 1.26, 1.0, 0.0], [4.122, 5.6, 0.0, 0.0]]))


def test_gae_hole_in_mask_is_skipped():
    # mask [1, 0, 1]: the next state of action 0 is action 2; gamma applies once.
    rewards = t([[1.0, 50.0, 2.0]])
    values = t([[0.5, 60.0, 1.0]])
    adv, _ = gae(rewards, values, t([[1, 0, 1]]), t([True]), t([0.0]), gamma=0.5, lam=1.0)
    # t=2: A = 2 - 1 = 1;  t=0: delta = 1 + 0.5*1 - 0.5 = 1, A = 1 + 0.5*1 = 1.5
    assert_close(adv, t([[1.5, 0.0, 1.0]]))


def _gae_reference(rewards, values, mask, terminated, last_values, gamma, lam):
    """Plain python loop over the valid indices of each row."""
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [i for i in range(T) if mask[b][i]]
        next_v = 0.0 if terminated[b] else float(last_values[b])
        next_a = 0.0
        for i in reversed(idx):
            delta = float(rewards[b][i]) + gamma * next_v - float(values[b][i])
            next_a = delta + gamma * lam * next_a
            adv[b][i] = next_a
            next_v = float(values[b][i])
    adv = torch.tensor(adv)
    return adv, torch.where(mask.bool(), adv + values, torch.zeros_like(adv))


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_python_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 9
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).long()
    mask[0, 2] = 0  # a hole (tool output inside the response)
    # large garbage at padding must not leak anywhere
    rewards = torch.where(mask.bool(), rewards, t(1e6))
    values = torch.where(mask.bool(), values, t(-1e6))
    terminated = torch.rand(B, generator=g) < 0.5
    last_values = torch.randn(B, generator=g)
    got = gae(rewards, values, mask, terminated, last_values, gamma=0.97, lam=0.9)
    want = _gae_reference(rewards, values, mask, terminated, last_values, 0.97, 0.9)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_grpo_golden_interleaved_groups():
    # group 7 at positions 0,1,2 (scores 1,0,2), group 3 at 3,5 (4,4), group 9 single at 4,
    # group 100 at 6,7 (0,1)
    scores = t([1.0, 0.0, 2.0, 4.0, 5.0, 4.0, 0.0, 1.0])
    groups = t([7, 7, 7, 3, 9, 3, 100, 100])
    adv, zero_var = grpo_advantages(scores, groups)
    # group 7: mean 1, unbiased var = (0 + 1 + 1)/2 = 1, std 1 -> (r - 1)/(1 + 1e-6)
    # group 100: mean 0.5, unbiased var = (0.25 + 0.25)/1 = 0.5, std 0.7071068
    #            -> +-0.5/0.7071078 = +-0.7071058
    # groups 3 (zero variance) and 9 (single sample) -> exactly 0
    d = 1 + 1e-6
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_close(adv, t([0.0, -1 / d, 1 / d, 0.0, 0.0, 0.0, -s, s]))
    assert zero_var.tolist() == [False, False, False, True, True, True, False, False]


def test_grpo_dr_grpo_no_std():
    scores = t([1.0, 0.0, 2.0, 4.0, 5.0, 4.0, 0.0, 1.0])
    groups = t([7, 7, 7, 3, 9, 3, 100, 100])
    adv, _ = grpo_advantages(scores, groups, norm_by_std=False)
    # r - mean_g only: group 7 mean 1, group 100 mean 0.5
    assert_close(adv, t([0.0, -1.0, 1.0, 0.0, 0.0, 0.0, -0.5, 0.5]))


def test_grpo_zero_variance_is_exact():
    # 0.1 is not representable: a float mean may differ from 0.1 by an ulp, and a naive
    # (r - mean)/(std + eps) would give ~1e-8/1e-6 = 0.01 instead of 0.
    adv, zero_var = grpo_advantages(t([0.1, 0.1, 0.1, 0.3]), t([0, 0, 0, 1]))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert zero_var.all()


def test_grpo_integer_scores():
    adv, _ = grpo_advantages(t([1, 0]), t([0, 0]), norm_by_std=False)
    assert_close(adv, t([0.5, -0.5]))


def test_rloo_golden():
    scores = t([1.0, 0.0, 2.0, 4.0, 5.0, 4.0])
    groups = t([7, 7, 7, 3, 9, 3])
    # group 7: 1 - (0+2)/2 = 0;  0 - (1+2)/2 = -1.5;  2 - (1+0)/2 = 1.5
    # group 3: 4 - 4 = 0 twice; group 9 single -> 0
    assert_close(rloo_advantages(scores, groups), t([0.0, -1.5, 1.5, 0.0, 0.0, 0.0]))


def test_reinforce_pp_golden():
    rewards = t([[0.0, 0.0, 1.0, 9.0], [0.0, 2.0, 0.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # returns-to-go, gamma 0.5: row 0: [0.25, 0.5, 1]; row 1: [1, 2]
    # batch mean = 4.75/5 = 0.95; deviations [-0.7, -0.45, 0.05, 0.05, 1.05]
    # var = (0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025)/5 = 0.36, std = 0.6
    assert_close(adv, t([[-0.7 / 0.6, -0.75, 0.05 / 0.6, 0.0], [0.05 / 0.6, 1.75, 0.0, 0.0]]))


def test_reinforce_pp_baseline_golden():
    scores = t([1.0, 3.0, 5.0])
    groups = t([0, 0, 1])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 0]])
    adv = reinforce_pp_baseline_advantages(scores, groups, mask)
    # baselined: group 0 mean 2 -> [-1, +1]; group 1 single -> 0
    # tokens (gamma 1: broadcast): [-1, -1 | 1 | 0, 0]; mean -0.2
    # deviations [-0.8, -0.8, 1.2, 0.2, 0.2]; var = (0.64*2 + 1.44 + 0.04*2)/5 = 0.56
    s = math.sqrt(0.56)
    assert_close(adv, t([[-0.8 / s, -0.8 / s, 0.0], [1.2 / s, 0.0, 0.0], [0.2 / s, 0.2 / s, 0.0]]))


def test_reinforce_pp_baseline_with_kl_token_rewards():
    scores = t([1.0, 3.0, 5.0])
    groups = t([0, 0, 1])
    mask = t([[1, 1, 0], [1, 0, 0], [1, 1, 0]])
    kl_rewards = t([[-0.1, -0.1, 100.0], [-0.2, 100.0, 100.0], [0.0, 0.0, 100.0]])  # 100 = padding
    adv = reinforce_pp_baseline_advantages(scores, groups, mask, token_rewards=kl_rewards)
    # return-to-go (gamma 1): row 0: t1 = -1 - 0.1 = -1.1, t0 = -1.1 - 0.1 = -1.2
    #                         row 1: 1 - 0.2 = 0.8;  row 2: [0, 0]
    # mean = (-1.2 - 1.1 + 0.8)/5 = -0.3; deviations [-0.9, -0.8, 1.1, 0.3, 0.3]
    # var = (0.81 + 0.64 + 1.21 + 0.09 + 0.09)/5 = 0.568
    s = math.sqrt(0.568)
    assert_close(adv, t([[-0.9 / s, -0.8 / s, 0.0], [1.1 / s, 0.0, 0.0], [0.3 / s, 0.3 / s, 0.0]]))
