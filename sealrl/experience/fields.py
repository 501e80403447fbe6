"""The declared fields of an experience batch: each declared once, with dtype, alignment and
the roles allowed to produce it.

`fact` fields are what happened (sealed, write-once, persisted); `derived` fields are
recomputable from facts and hyper-parameters (shaped rewards, advantages, returns), so changing
beta, gamma or lambda never needs a new rollout.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from sealrl.experience.records import Role


class Align(str, enum.Enum):
    SAMPLE = "sample"   # one value per sample: shape (B,), or a list of length B
    TOKEN = "token"     # one value per response token: shape (B, R), right-padded


class Kind(str, enum.Enum):
    FACT = "fact"
    DERIVED = "derived"


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    dtype: torch.dtype | None   # None: a Python list of records, one per sample
    align: Align
    producers: tuple[Role, ...]
    kind: Kind
    doc: str


def _spec(name, dtype, align, producers, kind, doc) -> FieldSpec:
    return FieldSpec(name, dtype, Align(align), tuple(producers), Kind(kind), doc)


R = Role
FIELDS: dict[str, FieldSpec] = {s.name: s for s in (
    _spec("response_mask", torch.bool, "token", [R.ROLLOUT], "fact",
          "1 on action tokens (sampled by the policy), 0 on padding and tool output"),
    _spec("rollout_log_probs", torch.float32, "token", [R.ROLLOUT], "fact",
          "behaviour log-probs, log_softmax(logits / T) of the sampler, no top-k/p filtering"),
    _spec("filtered_log_probs", torch.float32, "token", [R.ROLLOUT], "fact",
          "log-probs of the filtered (top-k/top-p) sampling distribution, when filtering was on"),
    _spec("old_log_probs", torch.float32, "token", [R.ACTOR, R.ROLLOUT], "fact",
          "proximal anchor of the PPO ratio: actor forward before any update (recompute), "
          "or the rollout log-probs themselves (bypass); computed once"),
    _spec("sum_pi_squared", torch.float32, "token", [R.ACTOR], "fact",
          "sum_v pi_old(v)^2 of the old policy at each response token (the optimal token baseline)"),
    _spec("ref_log_probs", torch.float32, "token", [R.REFERENCE], "fact",
          "log-probs of the frozen reference model; the KL anchor only"),
    _spec("values", torch.float32, "token", [R.CRITIC], "fact",
          "critic V(s_t) of the state before response token t"),
    _spec("last_values", torch.float32, "sample", [R.CRITIC], "fact",
          "critic value of the state after the last response token (bootstrap at truncation)"),
    _spec("reward_records", None, "sample", [R.REWARD], "fact",
          "RewardRecord per sample: total, components, scorer, status, message"),
    _spec("baseline_scores", torch.float32, "sample", [R.REWARD], "fact",
          "ReMax: reward total of the greedy response to the sample's prompt (same version, top-k 1)"),
    _spec("scores", torch.float32, "sample", [R.DRIVER], "derived",
          "sequence score used for training, from ok reward records after the error policy"),
    _spec("token_rewards", torch.float32, "token", [R.DRIVER], "derived",
          "shaped per-token rewards (score at the last token, minus KL in reward)"),
    _spec("advantages", torch.float32, "token", [R.DRIVER], "derived", "per-token advantages"),
    _spec("returns", torch.float32, "token", [R.DRIVER], "derived", "critic targets"),
    # multi-turn episodes (sealrl/experience/episode.py); absent from single-turn batches
    _spec("observation_mask", torch.bool, "token", [R.ROLLOUT], "fact",
          "1 on observation tokens (environment / tool output): holes, never trained"),
    _spec("step_rewards", torch.float32, "token", [R.ROLLOUT], "fact",
          "environment step rewards, each on the last policy token of its turn"),
    _spec("episodes", None, "sample", [R.ROLLOUT], "fact",
          "EpisodeRecord per sample: turns (sampled ids, stop reason, version, observation, status)"),
    # partial rollouts (rollout.partial=switch, sealrl/rollout/switching.py); absent otherwise
    _spec("token_versions", torch.int32, "token", [R.ROLLOUT], "fact",
          "step of the policy version that sampled each response token (a declared version of the batch)"),
    _spec("zero_variance", torch.bool, "sample", [R.DRIVER], "derived",
          "sample belongs to a group whose scores have zero variance (advantage 0)"),
)}
