"""The audit of multi-turn episodes (DESIGN section 10), from the sealed records alone:

    trained ids are the sampled ids: the response the actor trained on is, token for token,
    the concatenation of each turn's sampled ids and its observation ids;
    no observation token carries loss, KL or entropy: response_mask (which gates all three in
    the actor) is 1 exactly on policy tokens, observation_mask exactly on observation tokens,
    and advantages and token rewards are 0 on every observation token;
    every policy token was sampled by the row's policy version; step rewards sit where the
    turns put them; a failed tool or environment call carries no reward.
"""
from __future__ import annotations

from typing import Iterator

from sealrl.audit.folder import RunFolder
from sealrl.audit.report import Violation
from sealrl.experience.episode import EnvStatus, EpisodeRecord

_ZERO_ON_HOLES = ("advantages", "token_rewards", "rollout_log_probs")


def check_episodes(run: RunFolder) -> Iterator[Violation]:
    multi = run.cfg.env.name != "none"
    for f in run.readable:
        c = f.cols
        if "episodes" not in c:
            if multi:
                yield Violation("episodes", f"env.name={run.cfg.env.name} but no episodes column", f.iteration)
            continue
        for i in range(f.num_rows):
            yield from _row(f.iteration, c, i)


def _row(iteration: int, c: dict, i: int) -> Iterator[Violation]:
    v = lambda msg: Violation("episodes", msg, iteration, sample_id=c["sample_id"][i])  # noqa: E731
    try:
        ep = EpisodeRecord.from_json(c["episodes"][i])
    except Exception as e:  # noqa: BLE001 - an unreadable record is a finding
        yield v(f"episode record does not parse: {type(e).__name__}: {e}")
        return
    response = tuple(c["response_ids"][i])
    if response != ep.response_ids:
        at = next((t for t, (a, b) in enumerate(zip(response, ep.response_ids)) if a != b),
                  min(len(response), len(ep.response_ids)))
        yield v(f"trained ids differ from the sampled turns at response token {at}")
        return
    policy = ep.policy_mask()
    mask = [bool(x) for x in c["response_mask"][i]]
    trained_obs = [t for t, (m, p) in enumerate(zip(mask, policy)) if m and not p]
    if trained_obs:
        yield v(f"observation tokens {trained_obs[:5]} have response_mask 1: they would carry loss, KL and entropy")
    untrained = [t for t, (m, p) in enumerate(zip(mask, policy)) if p and not m]
    if untrained:
        yield v(f"sampled policy tokens {untrained[:5]} have response_mask 0")
    if [bool(x) for x in c.get("observation_mask", [[]] * (i + 1))[i]] != [not p for p in policy]:
        yield v("observation_mask is not the complement of the policy tokens of the turns")
    for name in _ZERO_ON_HOLES:
        row = c.get(name, [None] * (i + 1))[i]
        if row is not None and any(x != 0 for x, p in zip(row, policy) if not p):
            yield v(f"{name} is non-zero on an observation token")
    if c.get("step_rewards") and list(c["step_rewards"][i]) != ep.step_reward_row():
        yield v("step_rewards are not each turn's step reward on its last token")
    for k, turn in enumerate(ep.turns):
        if turn.ids and turn.version != c["policy_version"][i]:
            yield v(f"turn {k} was sampled by {turn.version}, the row says {c['policy_version'][i]}")
        if turn.step_reward is not None and turn.status not in (EnvStatus.OK, EnvStatus.NONE):
            yield v(f"turn {k}: failed call ({turn.status.value}) carries a step reward {turn.step_reward}")
    if "stop_reason" in c and c["stop_reason"][i] != ep.end.value:
        yield v(f"stop reason {c['stop_reason'][i]} is not the episode's end ({ep.end.value})")
