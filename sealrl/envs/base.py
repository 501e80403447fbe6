"""The environment protocol: what a multi-turn episode talks to between policy turns.

An environment is a plain object (built-in, or `module:Class` / `file.py:Class` from config):

    state = env.reset(prompt)            # one episode from a dataset row (Prompt-like: text,
                                         # token_ids, ground_truth, data_source, prompt_id)
    step  = env.step(state, turn_text)   # the policy's turn, decoded; -> EnvStep

`EnvStep.observation` is text (encoded once by the episode runner, never re-encoded) or a tuple
of token ids (appended as they are). `reward` is an optional step reward, placed on the last
token of the turn it answers. `done` ends the episode. `status` names a failure (a raising,
hung or flooding tool): a failure is recorded in the episode, never turned into a reward, so an
environment must not put a reward on an EnvStep whose status is not OK.

`stops` are the strings that end a policy turn early (a tool call's closing tag): the turn's
last token is the one that completes the string, and the environment is asked to answer.
`close()` releases worker processes. Environments hold no randomness of their own: an episode
is a function of its row and of the policy's tokens, so a resumed run replays it exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from sealrl.experience.episode import EnvStatus


@dataclass(frozen=True, slots=True)
class EnvStep:
    """The environment's answer to one policy turn."""

    observation: str | tuple[int, ...] = ""
    reward: float | None = None
    done: bool = False
    status: EnvStatus = EnvStatus.OK
    tool: str = ""
    message: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", EnvStatus(self.status))
        if self.reward is not None:
            if self.status is not EnvStatus.OK:
                raise ValueError(f"EnvStep: status {self.status.value} must not carry a reward "
                                 f"(got {self.reward!r}); a failure is not a reward")
            if not math.isfinite(self.reward):
                raise ValueError(f"EnvStep: step reward {self.reward!r} is not finite")
        if not isinstance(self.observation, str):
            object.__setattr__(self, "observation", tuple(int(t) for t in self.observation))


class Environment(Protocol):
    name: str          # recorded with every episode (name@version)
    version: str
    stops: tuple[str, ...]

    def reset(self, prompt: Any) -> Any: ...

    def step(self, state: Any, turn_text: str) -> EnvStep: ...

    def close(self) -> None: ...
