"""Advantages across turns, against values derived by hand: the outcome reward on the
episode's last policy token, step rewards on the last token of their turn, GAE skipping the
observation holes, outcome advantages broadcast over policy tokens only; the episode facts
survive the store and the seal covers them."""
from __future__ import annotations

import pytest
import torch

from sealrl.config import AlgorithmConfig
from sealrl.experience import (
    ExperienceBatch,
    PolicyVersion,
    RewardRecord,
    Role,
    SampleMeta,
    SamplingContract,
    StopReason,
)
from sealrl.experience.episode import EnvStatus, EpisodeRecord, TurnRecord
from sealrl.experience.store import read_iteration, write_iteration
from sealrl.trainer.derive import derive
from sealrl.trainer.variants.episodes import action_masks, episode_metrics, put_episode_facts

V = PolicyVersion("run", 0, 0, "w", "t", "c")


class _S:   # the two attributes put_episode_facts / action_masks read of a RolloutSample
    def __init__(self, episode):
        self.episode, self.response_ids = episode, episode.response_ids


def episode(step_reward, final_ids=(13, 2)) -> EpisodeRecord:
    """Policy (11, 12) -> observation (30,) -> policy final_ids: mask [1, 1, 0, 1, 1]."""
    return EpisodeRecord("calc@1", (
        TurnRecord((11, 12), StopReason.TOOL, V.id, 5, (30,), EnvStatus.OK, "calc", step_reward=step_reward),
        TurnRecord(tuple(final_ids), StopReason.EOS, V.id, 5)), StopReason.EOS)


def batch_of(episodes, totals) -> ExperienceBatch:
    samples = [SampleMeta(f"run/0/p/{k}", "run/0/p", "p", (4, 5), e.response_ids, e.end, V.id, k)
               for k, e in enumerate(episodes)]
    batch = ExperienceBatch("run", 0, samples, SamplingContract(max_new_tokens=4, n=len(samples)), [V])
    width = batch.num_response_tokens
    fake = [_S(e) for e in episodes]
    mask = torch.tensor([m + [False] * (width - len(m)) for m in action_masks(fake)])
    batch.put("response_mask", mask, Role.ROLLOUT, V.id)
    put_episode_facts(batch, fake, V.id)
    batch.put("rollout_log_probs", torch.where(mask, -0.5, 0.0), Role.ROLLOUT, V.id)
    batch.put("old_log_probs", torch.where(mask, -0.5, 0.0), Role.ROLLOUT, V.id)
    batch.put("reward_records", [RewardRecord.success(t, "tool_answer_match") for t in totals], Role.REWARD, "x@1")
    return batch


def test_gae_across_turns_skips_the_observation_hole():
    batch = batch_of([episode(0.5)], [1.0])
    # V(s_t) per token; 99 sits on the observation hole and must never enter a delta
    batch.put("values", torch.tensor([[0.1, 0.2, 99.0, 0.3, 0.4]]), Role.CRITIC, "critic@0")
    batch.put("last_values", torch.tensor([7.0]), Role.CRITIC, "critic@0")   # terminated: unused
    derive(batch, AlgorithmConfig(name="ppo", gamma=0.9, lam=0.8), 0.0, 4, "ppo@0")
    # rewards: 0.5 on token 1 (end of turn 0), 1.0 on token 4; valid tokens 0, 1, 3, 4
    # t4: d = 1.0 - 0.4 = 0.6                         A4 = 0.6
    # t3: d = 0.9*0.4 - 0.3 = 0.06                    A3 = 0.06 + 0.72*0.6 = 0.492
    # t1: d = 0.5 + 0.9*0.3 - 0.2 = 0.57 (next = t3)  A1 = 0.57 + 0.72*0.492 = 0.92424
    # t0: d = 0.9*0.2 - 0.1 = 0.08                    A0 = 0.08 + 0.72*0.92424 = 0.7454528
    assert batch.get("token_rewards").tolist()[0] == pytest.approx([0, 0.5, 0, 0, 1.0])
    assert batch.get("advantages").tolist()[0] == pytest.approx([0.7454528, 0.92424, 0.0, 0.492, 0.6])
    assert batch.get("returns").tolist()[0] == pytest.approx([0.8454528, 1.12424, 0.0, 0.792, 1.0])


def test_grpo_outcome_plus_step_rewards_broadcast_over_policy_tokens_only():
    batch = batch_of([episode(0.5), episode(None, final_ids=(14, 15, 2))], [1.0, 0.0])
    derive(batch, AlgorithmConfig(name="grpo"), 0.0, 4, "grpo@0")
    # sequence scores 1.0 + 0.5 = 1.5 and 0.0: mean 0.75, unbiased std sqrt(2 * 0.75^2) = 1.0607
    # advantage +-0.75 / 1.0607 = +-0.7071 on policy tokens, 0 on the observation and padding
    a = 0.75 / (2 * 0.75 ** 2) ** 0.5
    adv = batch.get("advantages").tolist()
    assert adv[0] == pytest.approx([a, a, 0, a, a, 0], abs=1e-4)
    assert adv[1] == pytest.approx([-a, -a, 0, -a, -a, -a], abs=1e-4)


def test_episode_facts_round_trip_the_store_under_the_seal(tmp_path):
    batch = batch_of([episode(0.5)], [1.0])
    batch.seal(required=("response_mask", "rollout_log_probs", "episodes", "observation_mask"))
    back = read_iteration(write_iteration(tmp_path, batch))          # verifies the digest
    assert back.get("episodes") == batch.get("episodes")
    assert back.get("observation_mask").tolist() == [[False, False, True, False, False]]
    assert back.get("step_rewards").tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0]]
    edited = EpisodeRecord("calc@1", batch.get("episodes")[0].turns[:1], StopReason.EOS)
    batch._fields["episodes"] = batch._fields["episodes"].__class__([edited], Role.ROLLOUT, V.id)
    with pytest.raises(Exception, match="changed after sealing"):
        batch.verify_seal()


def test_episode_metrics_by_hand():
    fails = EpisodeRecord("calc@1", (TurnRecord((1,), StopReason.TOOL, V.id, 0, (7, 7), EnvStatus.TIMEOUT, "calc"),
                                     TurnRecord((2,), StopReason.MAX_TURNS, V.id, 0)), StopReason.MAX_TURNS)
    m = episode_metrics([_S(episode(0.5)), _S(fails)])
    # turns: 2 + 2 = 4; env calls: the two TOOL turns (ok, timeout); policy tokens 4 + 2; observation 1 + 2
    assert m["episode/turns_mean"] == 2.0 and m["episode/env_calls"] == 2.0
    assert (m["episode/policy_tokens"], m["episode/observation_tokens"]) == (6.0, 3.0)
    assert m["episode/timeout_frac"] == 0.5 and m["episode/error_frac"] == 0.0
    assert m["episode/turn_stop_tool_frac"] == 0.5 and m["episode/end_max_turns_frac"] == 0.5
