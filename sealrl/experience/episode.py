"""The record of a multi-turn episode (DESIGN section 10): one token sequence, an owner per
token, and per turn what the policy sampled, why its turn ended, which version sampled it and
what the environment answered.

The response of an episode is every token after the prompt, in order: policy turn 0, its
observation, policy turn 1, ... A turn's `ids` are the policy tokens exactly as sampled and
`observation_ids` the environment's answer exactly as encoded once; the batch's response ids
are their concatenation, and the audit checks that they still are. Policy tokens are actions
(response_mask 1); observation tokens are holes (response_mask 0, observation_mask 1): no loss,
KL or entropy ever touches them.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass

from sealrl.experience.records import StopReason


class EnvStatus(str, enum.Enum):
    """What the environment (or tool) did with a turn. Anything but OK and NONE is a named
    failure: it is recorded, never turned into a reward."""

    OK = "ok"               # answered
    NONE = "none"           # not asked (the episode ended at this turn without a call)
    ERROR = "error"         # the tool / environment raised
    TIMEOUT = "timeout"     # past its deadline (the worker was killed)
    FLOOD = "flood"         # answered more than the observation budget; truncated and marked
    BAD_CALL = "bad_call"   # the call could not be parsed or names no tool


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One policy turn and the environment's answer to it."""

    ids: tuple[int, ...]               # policy tokens, as sampled
    stop_reason: StopReason            # eos | stop | tool | length | max_turns
    version: str                       # PolicyVersion.id that sampled every token of `ids`
    seed: int                          # per-candidate seed of this turn's sampling
    observation_ids: tuple[int, ...] = ()   # the environment's answer, encoded once
    status: EnvStatus = EnvStatus.NONE
    tool: str = ""                     # the tool called, if any
    message: str = ""                  # the environment's error / truncation note
    obs_truncated: bool = False        # the observation was cut to env.max_observation_tokens
    step_reward: float | None = None   # placed on the last token of `ids`

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_reason"], d["status"] = self.stop_reason.value, self.status.value
        d["ids"], d["observation_ids"] = list(self.ids), list(self.observation_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TurnRecord":
        return cls(ids=tuple(d["ids"]), stop_reason=StopReason(d["stop_reason"]), version=d["version"],
                   seed=int(d["seed"]), observation_ids=tuple(d["observation_ids"]),
                   status=EnvStatus(d["status"]), tool=d["tool"], message=d["message"],
                   obs_truncated=bool(d["obs_truncated"]), step_reward=d["step_reward"])


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """All turns of one episode, and why it ended (the sample's stop reason)."""

    env: str                           # environment name@version
    turns: tuple[TurnRecord, ...]
    end: StopReason                    # eos | stop (env done) | length | max_turns | error

    @property
    def response_ids(self) -> tuple[int, ...]:
        return tuple(t for turn in self.turns for t in (*turn.ids, *turn.observation_ids))

    def spans(self) -> list[tuple[int, int, int]]:
        """Per turn (policy start, policy end = observation start, observation end), offsets
        into the response."""
        out, pos = [], 0
        for turn in self.turns:
            a, b = pos, pos + len(turn.ids)
            pos = b + len(turn.observation_ids)
            out.append((a, b, pos))
        return out

    def policy_mask(self) -> list[bool]:
        return [owner for turn in self.turns
                for owner in ([True] * len(turn.ids) + [False] * len(turn.observation_ids))]

    def step_reward_row(self) -> list[float]:
        """Per response token: each turn's step reward on the last token of that turn."""
        row = [0.0] * len(self.response_ids)
        for turn, (a, b, _) in zip(self.turns, self.spans()):
            if turn.step_reward is not None and b > a:
                row[b - 1] += float(turn.step_reward)
        return row

    def to_json(self) -> str:
        return json.dumps({"env": self.env, "end": self.end.value,
                           "turns": [t.to_dict() for t in self.turns]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EpisodeRecord":
        d = json.loads(text)
        return cls(d["env"], tuple(TurnRecord.from_dict(t) for t in d["turns"]), StopReason(d["end"]))
