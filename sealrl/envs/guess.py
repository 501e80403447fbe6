"""A guessing game: the genuinely multi-turn built-in environment.

The row's ground truth is a secret integer in [0, high]. Each policy turn is a guess ending in
"?" (the turn's stop string), e.g. "37?"; the environment answers "hi;" (the secret is higher),
"lo;" (lower) or "ok" (found: the episode ends). A turn without a readable guess is a BAD_CALL
(answered "bad;", recorded). To do better than chance the policy must read the answers it got:
a bisecting policy finds any secret of [0, 99] in 7 turns.

`step_penalty` (default 0: no step rewards) puts -step_penalty on every wrong guess, so the
step-reward path has a built-in user. The outcome reward is GuessVerifier's.
"""
from __future__ import annotations

import re

from sealrl.envs.base import EnvStep
from sealrl.experience.episode import EnvStatus

_GUESS = re.compile(r"(-?\d+)\?\s*$")


def secret_of(ground_truth) -> int:
    try:
        return int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"guess: ground_truth must be an integer, got {ground_truth!r}") from None


class GuessEnv:
    name = "guess"
    version = "1"
    stops = ("?",)

    def __init__(self, step_penalty: float = 0.0) -> None:
        self.step_penalty = float(step_penalty)

    def reset(self, prompt) -> int:
        return secret_of(prompt.ground_truth)

    def step(self, secret: int, turn_text: str) -> EnvStep:
        m = _GUESS.search(turn_text)
        if m is None:
            if not turn_text.rstrip().endswith("?"):
                return EnvStep(done=True, status=EnvStatus.NONE)   # the policy gave up (eos)
            return EnvStep("bad;", status=EnvStatus.BAD_CALL, message="no integer before '?'")
        guess = int(m.group(1))
        penalty = -self.step_penalty if self.step_penalty else None
        if guess == secret:
            return EnvStep("ok", done=True)
        return EnvStep("hi;" if secret > guess else "lo;", reward=penalty)

    def close(self) -> None:
        pass
