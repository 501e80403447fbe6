"""rollout.partial=switch: the generation lane's side of partial rollouts (docs/async.md).

With `finish` (the default) a publication never touches a generation in flight: every response
is sampled by the one version its iteration was given (the fixed lag, trainer/pipeline.py).
With `switch`, the lane's generate calls go through rollout/switching.py: when the training
lane publishes a version while an iteration is being generated, the rows still running go on
under it from their next token (prefix prefilled again under the new version). Which token a
switch lands on depends on timing, so it is recorded: each token's version is a sealed fact
(`token_versions`, the step of the version that sampled it, every version declared in the
batch), and a replay follows that record (`plan`) instead of the clock.

The staleness of a sample is then the consuming actor's version minus the oldest version among
its tokens, which is the version its iteration started from (a switch only moves to newer ones).
"""
from __future__ import annotations

import copy

import torch

from sealrl.experience import ExperienceBatch, Role, pad_token_rows
from sealrl.experience.wire import RolloutSample
from sealrl.rollout.switching import token_steps
from sealrl.seams.rollout import switching


class SwitchingRollout:
    """The lane's rollout client for one iteration (seams/rollout.py): generate switches versions
    on publications (`plan` None) or at a replay's recorded tokens (rollout/switching.py, where
    the client runs); every other member is the wrapped client's. Its capabilities are the
    wrapped client's, switching (no episodes)."""

    def __init__(self, rollout, plan: dict | None, resolve) -> None:
        self._rollout, self._plan, self._resolve = rollout, plan, resolve
        self.capabilities = switching(rollout.capabilities)

    @property
    def version(self):
        return self._rollout.version

    @property
    def backend(self) -> tuple[str, str]:
        return self._rollout.backend

    def generate(self, requests, contract, version, stream=None) -> list[RolloutSample]:
        return self._rollout.generate_switching(requests, contract, version, self._plan, self._resolve,
                                                stream=stream)

    def generate_switching(self, requests, contract, version, plan=None, resolve=None,
                           stream=None) -> list[RolloutSample]:
        return self._rollout.generate_switching(requests, contract, version, plan, resolve, stream=stream)

    def load(self, state, manifest):
        return self._rollout.load(state, manifest)

    def retain(self, versions: int) -> None:
        self._rollout.retain(versions)

    def pin_base(self, state, manifest) -> str:
        return self._rollout.pin_base(state, manifest)

    def take_served(self) -> list[dict]:
        return self._rollout.take_served()

    def take_recoveries(self) -> list[float]:
        return self._rollout.take_recoveries()

    def take_engine_stats(self) -> dict[str, float]:
        return self._rollout.take_engine_stats()

    def close(self) -> None:
        self._rollout.close()


def lane_run(run, plan: dict | None = None, resolve=None):
    """`run` as the lane generates an iteration with: unchanged with rollout.partial=finish;
    with switch, its rollout switches on publications, or follows a replay's recorded `plan`
    (first token -> key; `resolve(key)` is the version, once the rollout holds it; in the
    generation process the keys are the recorded versions and it waits for them there)."""
    if run.cfg.rollout.partial != "switch":
        return run
    out = copy.copy(run)
    out.roles = copy.copy(run.roles)
    out.roles.rollout = SwitchingRollout(run.roles.rollout, plan, resolve)
    return out


def sample_versions(sample: RolloutSample) -> list:
    """Every version that sampled a token of `sample`, oldest first."""
    return [v for _, v in sample.segments] or [sample.policy_version]


def span_versions(samples: list[RolloutSample], version) -> list:
    """The batch's declared versions: `version` (its iteration's) and every later one a token has."""
    later = {v.id: v for s in samples for v in sample_versions(s) if v.id != version.id}
    return [version, *later.values()]


def put_token_versions(batch: ExperienceBatch, samples: list[RolloutSample], version_id: str) -> None:
    """The sealed per-token versions, when the samples carry segments (rollout.partial=switch)."""
    if any(s.segments for s in samples):
        batch.put("token_versions", pad_token_rows([token_steps(s) for s in samples], batch.num_response_tokens,
                                                   torch.int32), Role.ROLLOUT, version_id)


def recorded_plan(batch: ExperienceBatch) -> dict[int, int]:
    """A sealed iteration's switch schedule, first token -> step of the version from there on
    (one list for the iteration: its samples come from one generate call); {} when none switched.
    ValueError when the samples' schedules disagree (e.g. a retried call switched elsewhere)."""
    if not batch.has("token_versions"):
        return {}
    plan: dict[int, int] = {}
    rows = batch.get("token_versions").tolist()
    for s, row in zip(batch.samples, rows):
        steps = row[:len(s.response_ids)]
        for t in range(1, len(steps)):
            if steps[t] != steps[t - 1] and plan.setdefault(t, steps[t]) != steps[t]:
                raise ValueError(f"sample {s.sample_id} switches to step {steps[t]} at token {t}, another "
                                 f"sample of the iteration to step {plan[t]}")
    for s, row in zip(batch.samples, rows):   # a row that ran past a switch point took it
        for t, step in plan.items():
            if t < len(s.response_ids) and row[t] != step:
                raise ValueError(f"sample {s.sample_id} did not switch at token {t} like the rest of the iteration")
    return dict(sorted(plan.items()))
