"""Scores and advantages of episodes that the policy did not write in full, by hand: the soft
overlong penalty counts policy tokens only (observations are the environment's), and
REINFORCE++-baseline takes the step rewards of the turns, like every other estimator."""
from __future__ import annotations

import pytest

from sealrl.config import AlgorithmConfig
from sealrl.experience import RewardRecord
from sealrl.trainer.derive import derive
from sealrl.trainer.variants.dynamic import zero_variance
from tests.test_episode_advantages import batch_of, episode

SOFT = AlgorithmConfig(name="grpo", overlong="soft", overlong_buffer=2, overlong_penalty=1.0)


def test_soft_overlong_penalty_counts_policy_tokens_only():
    # A: policy (11, 12), observation (30,), policy (13, 2): 4 policy tokens of 5
    # B: policy (11, 12), observation (30,), policy (14, 15, 2): 5 policy tokens of 6
    batch = batch_of([episode(None), episode(None, final_ids=(14, 15, 2))], [1.0, 1.0])
    derive(batch, SOFT, 0.0, 5, "grpo@0")
    # the buffer starts at token 5 - 2 = 3: A is (4 - 3) / 2 = 0.5 into it, B (5 - 3) / 2 = 1.0
    # (counting the observation token, A would be 1.0 in and both scores 0.0)
    assert batch.get("scores").tolist() == pytest.approx([0.5, 0.0])


def test_dynamic_sampling_filter_judges_the_same_policy_token_scores():
    class _S:
        def __init__(self, k, e):
            self.sample_id, self.episode, self.response_ids = f"s{k}", e, e.response_ids

    samples = [_S(0, episode(None)), _S(1, episode(None, final_ids=(14, 15, 2)))]
    records = {s.sample_id: RewardRecord.success(1.0, "x") for s in samples}
    assert zero_variance(samples, records, SOFT, 5) is None     # 0.5 and 0.0 as above: signal
    plain = AlgorithmConfig(name="grpo")
    assert zero_variance(samples, records, plain, 5) == 1.0      # without the penalty both score 1


def test_reinforce_pp_baseline_takes_the_step_rewards():
    # A: mask [1, 1, 0, 1, 1], step reward 0.5 on token 1 (end of turn 0), total 1.0
    # B: mask [1, 1, 0, 1, 1, 1], no step reward, total 0.0; one group, beta 0, gamma 1
    batch = batch_of([episode(0.5), episode(None, final_ids=(14, 15, 2))], [1.0, 0.0])
    derive(batch, AlgorithmConfig(name="reinforce_pp_baseline", gamma=1.0), 0.0, 4, "rpb@0")
    # baselined scores 1.0 - 0.5 = 0.5 and -0.5 on the last policy tokens (A: token 4, B: token 5)
    # returns-to-go over policy tokens: A [1.0, 1.0, -, 0.5, 0.5] (the step reward counts before
    # token 2), B [-0.5] * 5. Whitened over the 9 valid tokens: mean 0.5 / 9 = 1/18,
    # centred 17/18 (x2), 8/18 (x2), -10/18 (x5); variance (2*289 + 2*64 + 5*100) / 324 / 9
    std = ((2 * 289 + 2 * 64 + 5 * 100) / 324 / 9) ** 0.5
    hi, lo, neg = 17 / 18 / std, 8 / 18 / std, -10 / 18 / std
    adv = batch.get("advantages").tolist()
    assert adv[0] == pytest.approx([hi, hi, 0.0, lo, lo, 0.0], abs=1e-5)
    assert adv[1] == pytest.approx([neg, neg, 0.0, neg, neg, neg], abs=1e-5)
