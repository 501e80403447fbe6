"""Fault drills (sealrl/faults.py): when SEALRL_FAULTS is set, the roles are wrapped so that a
planned fault fires where the stage of that name calls its role; otherwise nothing here runs.

Each wrapper passes every call through to the role, except at its planned point:
    generate      rollout.generate: raise | kill | hang | delay | twice (samples delivered twice)
                  | late (the call fails as past its deadline; its samples arrive afterwards)
    reward        reward.score: the same actions on the reward records
    reference     reference.compute
    old_log_prob  actor.compute_old_log_probs
    update        actor.update (before the actor's optimizer steps; the critic's ran already):
                  also kill_rank (the last data-parallel rank's process killed first)
    weight_sync   rollout.load: also corrupt (one tensor changed after the manifest was built)
The iteration of a point is that of the batch or requests the call carries; weight_sync's is
the iteration whose version the load publishes (the first iteration, then one after each update).
"""
from __future__ import annotations

import os

import torch

from sealrl import faults
from sealrl.experience import LateResults


def install(roles, first_iteration: int) -> None:
    """Wrap the roles in place when a fault plan is set; a no-op otherwise."""
    if not os.environ.get("SEALRL_FAULTS"):
        return
    clock = _Clock(first_iteration)
    roles.rollout = _Rollout(roles.rollout, clock)
    roles.reward = _Reward(roles.reward)
    roles.actor = _Actor(roles.actor, clock)
    if roles.reference is not None:
        roles.reference = _Reference(roles.reference)


class _Clock:
    def __init__(self, publishing: int) -> None:
        self.publishing = publishing   # the iteration the next weight sync publishes for


class _Wrapper:
    """Passes every attribute through to the wrapped role (reads and writes)."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


def _iteration_of(group_or_sample_id: str) -> int:
    return int(group_or_sample_id.split("/")[1])   # run/iteration/prompt[/candidate]


def _deliver(stage: str, iteration: int, call):
    """Run `call` at the planned point: twice doubles its results, late turns them into a
    LateResults failure (the results arrive after the retry)."""
    action = faults.point(stage, iteration)
    results = call()
    if action == "twice":
        return results + results
    if action == "late":
        raise LateResults(f"{stage}: the call missed its deadline (injected late delivery)", results)
    return results


class _Rollout:
    """A rollout client (seams/rollout.py) with the generate and weight_sync points; every other
    member passes through, and the capabilities are the wrapped client's."""

    def __init__(self, inner, clock: _Clock) -> None:
        self.inner, self.clock, self.capabilities = inner, clock, inner.capabilities

    @property
    def version(self):
        return self.inner.version

    @property
    def backend(self) -> tuple[str, str]:
        return self.inner.backend

    def generate(self, requests, contract, version, stream=None):
        it = _iteration_of(requests[0].group_id) if requests else -1
        kw = {} if stream is None else {"stream": stream}   # reward.stream's hook passes through
        return _deliver("generate", it, lambda: self.inner.generate(requests, contract, version, **kw))

    def generate_switching(self, requests, contract, version, plan=None, resolve=None, stream=None):
        return self.inner.generate_switching(requests, contract, version, plan, resolve, stream=stream)

    def load(self, state, manifest):
        if faults.point("weight_sync", self.clock.publishing) == "corrupt":
            state = dict(state)
            name = next(iter(state))
            state[name] = state[name].clone().flatten().index_fill_(0, torch.tensor([0]), 1e3).view_as(state[name])
        return self.inner.load(state, manifest)

    def retain(self, versions: int) -> None:
        self.inner.retain(versions)

    def pin_base(self, state, manifest) -> str:
        return self.inner.pin_base(state, manifest)

    def take_served(self) -> list[dict]:
        return self.inner.take_served()

    def take_recoveries(self) -> list[float]:
        return self.inner.take_recoveries()

    def take_engine_stats(self) -> dict[str, float]:
        return self.inner.take_engine_stats()

    def close(self) -> None:
        self.inner.close()


class _Reward(_Wrapper):
    def score(self, items):
        it = _iteration_of(items[0][0].sample_id) if items else -1
        return _deliver("reward", it, lambda: self.inner.score(items))


class _Reference(_Wrapper):
    def compute(self, batch) -> None:
        faults.point("reference", batch.iteration)
        self.inner.compute(batch)


class _Actor(_Wrapper):
    def __init__(self, inner, clock: _Clock) -> None:
        super().__init__(inner)
        object.__setattr__(self, "clock", clock)

    def compute_old_log_probs(self, batch, version, fuse=None) -> None:
        faults.point("old_log_prob", batch.iteration)
        self.inner.compute_old_log_probs(batch, version, fuse)

    def update(self, batch, version, iteration: int, seed: int, kl_coef: float) -> dict:
        if faults.point("update", iteration) == "kill_rank":
            group = getattr(getattr(self.inner, "replicas", None), "group", None)
            if not hasattr(group, "kill"):
                raise ValueError("SEALRL_FAULTS kill_rank needs data-parallel actor ranks on Ray "
                                 "(placement.actor_ranks > 1)")
            group.kill(group.num_workers - 1)
        metrics = self.inner.update(batch, version, iteration, seed, kl_coef)
        self.clock.publishing = iteration + 1
        return metrics
