"""Reward role: RewardFunction(sample) -> RewardRecord, in a pool of scorer processes with a
per-call deadline. Its own errors become status error/timeout records, never a score."""
from __future__ import annotations

from sealrl.experience import RewardRecord
from sealrl.experience.wire import RolloutSample
from sealrl.rewards.base import RewardSample
from sealrl.rewards.pool import RewardPool


class Reward:
    def __init__(self, fn, num_scorers: int, timeout_s: float, memory_mb: int = 0):
        self.pool = RewardPool(fn, num_scorers=num_scorers, timeout_s=timeout_s, memory_mb=memory_mb)
        self.fn, self.num_scorers, self.scorer = fn, num_scorers, fn.name

    def score(self, items: list[tuple[RolloutSample, str, str, object, str, dict]]) -> list[tuple[str, RewardRecord]]:
        """items: (sample, prompt text, response text, ground truth, data source, extra info). Returns
        (sample id, record) pairs, which the driver joins by sample id (the pool returns one
        record per sample in input order; a batch scorer's wrong count is an error per sample)."""
        samples = [_reward_sample(item) for item in items]
        return [(s.sample_id, r) for s, r in zip(samples, self.pool.score(samples), strict=True)]

    def take_served(self) -> tuple[list[dict], int]:
        """([{"scored_by": {sample id: scorer pid}}] or [], stray replies refused) since the last
        take: which scorer process answered each sample (served.jsonl), never an in-process one."""
        scored, stray = self.pool.take_scored()
        return ([{"scored_by": scored}] if scored else []), stray

    def stream(self) -> "RewardStream":
        """Score items as they are handed in, while the rollout still generates (reward.stream)."""
        return RewardStream(self.pool.stream())

    def close(self) -> None:
        self.pool.close()


class RewardStream:
    """`add(items)` as samples finish; `finish()` -> record per sample id (RewardPool.stream)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def add(self, items: list[tuple]) -> None:
        self._stream.add([_reward_sample(item) for item in items])

    def finish(self) -> dict[str, RewardRecord]:
        return self._stream.finish()


def _reward_sample(item: tuple) -> RewardSample:
    s, prompt, response, truth, source, extra = item
    return RewardSample(sample_id=s.sample_id, prompt=prompt, response=response, response_ids=tuple(s.response_ids),
                        ground_truth=truth, data_source=source, metadata=extra)
