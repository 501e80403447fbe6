"""The reward scorers off the driver (`placement.scorers=ray`): one Ray actor holds the reward
role, its pool of `reward.num_scorers` scorer processes (on that actor's node) and their
deadlines; the driver sends each batch's items and gets (sample id, record) pairs back, as from
the in-process role (roles/reward.py). A user's reward file travels as text with the scorer
(rewards/custom.CustomReward), so it need not exist on that node.

The actor's bundle asks for `reward.num_scorers` CPUs (at least 1) and `placement.rank_resources`
(where the training-side work may go). Each call's deadline is placement.timeout_s on top of what
the pool may take (its deadline per request, over the requests each scorer runs in turn), so a
slow scorer ends as its records' status timeout, never as a lost role. Not built: reward.stream
(refused at load). Its node, host and versions are in placement.json like every Ray worker's.
"""
from __future__ import annotations

import functools
import math


class RemoteReward:
    """The reward role's interface (`score`, `take_served`, `fn`, `num_scorers`) over a Ray
    worker group of one hosting roles.reward.Reward."""

    def __init__(self, group, fn, num_scorers: int, timeout_s: float, placement_timeout_s: float) -> None:
        self.group, self.fn, self.num_scorers = group, fn, num_scorers
        self.timeout_s, self.placement_timeout_s = timeout_s, placement_timeout_s
        self.scorer = fn.name

    def score(self, items: list[tuple]) -> list[tuple]:
        rounds = math.ceil(len(items) / max(1, self.num_scorers)) if self.num_scorers else 1
        deadline = self.placement_timeout_s + rounds * self.timeout_s
        return self.group.call("score", self.group.put(items), timeout_s=deadline)[0]

    def take_served(self) -> tuple[list[dict], int]:
        return self.group.call("take_served", timeout_s=self.placement_timeout_s)[0]

    def close(self) -> None:
        self.group.close()


def ray_reward(fn, reward_cfg, placement, closers: list) -> RemoteReward:
    """The reward role built inside its own Ray actor and bundle (see the module docstring)."""
    from sealrl.config.sections import ray_resources
    from sealrl.placement.workers import PoolSpec, RayPool, RayWorkerGroup
    from sealrl.roles.reward import Reward
    pool = RayPool(PoolSpec(name="reward", roles=("reward",), num_cpus_per_worker=max(1, reward_cfg.num_scorers),
                            strategy=placement.strategy.upper(),
                            resources=ray_resources(placement.rank_resources, "placement.rank_resources")),
                   timeout_s=placement.timeout_s)
    closers.append(pool.close)
    make = functools.partial(Reward, fn, reward_cfg.num_scorers, reward_cfg.timeout_s, reward_cfg.scorer_memory_mb)
    group = RayWorkerGroup("reward", make, pool, timeout_s=placement.timeout_s)
    closers.append(group.close)
    return RemoteReward(group, fn, reward_cfg.num_scorers, reward_cfg.timeout_s, placement.timeout_s)
