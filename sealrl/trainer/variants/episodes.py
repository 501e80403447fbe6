"""The driver's side of multi-turn episodes (rollout/episodes.py plays them): the episode
facts of the batch and the episode metrics. Single-turn samples (no episode) pass through
untouched. The row each environment starts from rides on every request, from where requests
are made (ledger.new_iteration, remax, evaluate)."""
from __future__ import annotations

from collections import Counter

import torch

from sealrl.experience import ExperienceBatch, Role, pad_token_rows
from sealrl.experience.episode import EnvStatus


def action_masks(samples) -> list[list[bool]]:
    """Per sample, True on the tokens the policy sampled (every response token of a single
    turn; the policy turns of an episode, never its observations)."""
    return [s.episode.policy_mask() if s.episode is not None else [True] * len(s.response_ids) for s in samples]


def put_episode_facts(batch: ExperienceBatch, samples, version_id: str) -> None:
    """observation_mask, step_rewards and the episode records, when the samples are episodes."""
    episodes = [s.episode for s in samples]
    if not episodes or episodes[0] is None:
        return
    width = batch.num_response_tokens
    batch.put("observation_mask", pad_token_rows([[not p for p in e.policy_mask()] for e in episodes], width,
                                                 torch.bool), Role.ROLLOUT, version_id)
    batch.put("step_rewards", pad_token_rows([e.step_reward_row() for e in episodes], width, torch.float32),
              Role.ROLLOUT, version_id)
    batch.put("episodes", episodes, Role.ROLLOUT, version_id)


def episode_metrics(samples) -> dict[str, float]:
    """episode/* metrics (docs/metrics.md); empty for single-turn samples."""
    episodes = [s.episode for s in samples if s.episode is not None]
    if not episodes:
        return {}
    turns = [t for e in episodes for t in e.turns]
    calls = [t for t in turns if t.status is not EnvStatus.NONE]
    policy = sum(len(t.ids) for t in turns)
    obs = sum(len(t.observation_ids) for t in turns)
    out = {"episode/turns_mean": len(turns) / len(episodes), "episode/env_calls": float(len(calls)),
           "episode/policy_tokens": float(policy), "episode/observation_tokens": float(obs),
           "episode/observation_truncated": float(sum(t.obs_truncated for t in turns))}
    status = Counter(t.status.value for t in calls)
    for s in (EnvStatus.ERROR, EnvStatus.TIMEOUT, EnvStatus.FLOOD, EnvStatus.BAD_CALL):
        out[f"episode/{s.value}_frac"] = status[s.value] / max(1, len(calls))
    for reason, n in Counter(t.stop_reason.value for t in turns).items():
        out[f"episode/turn_stop_{reason}_frac"] = n / len(turns)
    for reason, n in Counter(e.end.value for e in episodes).items():
        out[f"episode/end_{reason}_frac"] = n / len(episodes)
    return out
