"""Builders of small experience batches shared by the experience and store tests."""
from __future__ import annotations

import torch

from sealrl.experience import (
    ExperienceBatch,
    PolicyVersion,
    RewardRecord,
    RewardStatus,
    Role,
    SampleMeta,
    SamplingContract,
    StopReason,
    group_id,
    pad_token_rows,
    sample_id,
)

V0 = PolicyVersion("run", 0, 0, "w0", "tok", "cfg")
REF = PolicyVersion("reference", 0, 0, "wref", "tok", "cfg")


def make_batch(responses=((5, 6, 2), (7,), (), (8, 9, 10, 2)), texts=None, iteration=3):
    samples = []
    for k, resp in enumerate(responses):
        g = group_id("run", iteration, f"p{k // 2}")
        samples.append(SampleMeta(
            sample_id=sample_id(g, k % 2), group_id=g, prompt_id=f"p{k // 2}",
            prompt_ids=(4, 11, 14), response_ids=tuple(resp),
            stop_reason=StopReason.EOS if resp and resp[-1] == 2 else StopReason.LENGTH,
            policy_version=V0.id, seed=100 + k,
            prompt_text=(texts or {}).get(k, "07+"), response_text="x" * len(resp),
            data_source="arith", ground_truth='"25"'))
    batch = ExperienceBatch("run", iteration, samples, SamplingContract(max_new_tokens=4, n=2), [V0])
    width = batch.num_response_tokens
    logp = [[-0.5 - 0.1 * j for j in range(len(r))] for r in responses]
    batch.put("response_mask", pad_token_rows([[1] * len(r) for r in responses], width, torch.bool),
              Role.ROLLOUT, V0.id)
    batch.put("rollout_log_probs", pad_token_rows(logp, width, torch.float32), Role.ROLLOUT, V0.id)
    return batch


def add_rewards(batch):
    recs = [RewardRecord.success(1.0, "arith") if i % 3 else
            RewardRecord.failure(RewardStatus.TIMEOUT, "arith", "deadline 1s")
            for i in range(len(batch))]
    batch.put("reward_records", recs, Role.REWARD, "arith@1")
    return recs


class ScriptedRole:
    """A rollout or reward role whose k-th call answers `replies[k](request list)`; records
    what it was asked. Drives the production stage loops (trainer/collect.py) in tests."""

    scorer = "v"

    def __init__(self, *replies):
        self.replies, self.asked = list(replies), []

    def generate(self, requests, contract, version):
        self.asked.append(list(requests))
        return self.replies[len(self.asked) - 1](requests)

    def score(self, items):
        self.asked.append([s.sample_id for s, *_ in items])
        return self.replies[len(self.asked) - 1](self.asked[-1])


def stage_run(rollout=None, reward=None, reward_error="drop_group"):
    """The parts of trainer.setup.Run that collect.generate / collect.score read."""
    from types import SimpleNamespace
    return SimpleNamespace(roles=SimpleNamespace(rollout=rollout, reward=reward), contract=None,
                           cfg=SimpleNamespace(algorithm=SimpleNamespace(reward_error=reward_error)))
