"""Reward role: RewardFunction(sample) -> RewardRecord, in a pool of scorer processes with a
per-call deadline. Its own errors become status error/timeout records, never a score."""
from __future__ import annotations

from sealrl.experience import RewardRecord
from sealrl.rewards.base import RewardSample
from sealrl.rewards.pool import RewardPool
from sealrl.rollout.engine import RolloutSample


class Reward:
    def __init__(self, fn, num_scorers: int, timeout_s: float):
        self.pool = RewardPool(fn, num_scorers=num_scorers, timeout_s=timeout_s)
        self.scorer = fn.name

    def score(self, items: list[tuple[RolloutSample, str, str, object, str, dict]]) -> list[tuple[str, RewardRecord]]:
        """items: (sample, prompt text, response text, ground truth, data source, extra info). Returns
        (sample id, record) pairs, which the driver joins by sample id (the pool returns one
        record per sample in input order; a batch scorer's wrong count is an error per sample)."""
        samples = [RewardSample(sample_id=s.sample_id, prompt=prompt, response=response,
                                response_ids=tuple(s.response_ids), ground_truth=truth,
                                data_source=source, metadata=extra)
                   for s, prompt, response, truth, source, extra in items]
        return [(s.sample_id, r) for s, r in zip(samples, self.pool.score(samples), strict=True)]

    def close(self) -> None:
        self.pool.close()
