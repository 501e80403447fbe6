"""Outcome verifiers of the built-in environments' tasks (sealrl/envs): reward.fn=tool_answer
(data.task=mul3 with env.name=calc) and reward.fn=guess (data.task=guess with env.name=guess).
Picklable, like sealrl.rewards.verifiers; a wrong or malformed answer is a valid 0.0.

The response they read is the whole episode decoded: policy turns and observations. They
judge only what the policy wrote: the tool task's answer is the text after the last
observation, the guessing game's guesses are the policy's "N?" turns.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from sealrl.rewards.base import RewardSample
from sealrl.rewards.verifiers import DEFAULT_EOS_TEXT, answer_text


@dataclass(frozen=True)
class ToolAnswerMatch:
    """1.0 when the text after the last `</out>` (the whole text without a call) equals the
    ground truth, stripped and without a trailing eos text."""

    eos_text: str = DEFAULT_EOS_TEXT
    name: str = "tool_answer_match"
    version: str = "1"

    def __call__(self, sample: RewardSample) -> float:
        truth = sample.ground_truth
        if isinstance(truth, bool) or not isinstance(truth, (str, int)):
            raise ValueError(f"ground_truth must be a str or int, got {truth!r}")
        final = sample.response.rsplit("</out>", 1)[-1]
        return float(answer_text(final, self.eos_text) == str(truth).strip())


@dataclass(frozen=True)
class GuessVerifier:
    """1.0 when one of the policy's guesses ("N?") is the secret."""

    name: str = "guess"
    version: str = "1"

    def __call__(self, sample: RewardSample) -> float:
        try:
            secret = int(str(sample.ground_truth).strip())
        except ValueError:
            raise ValueError(f"guess: ground_truth must be an integer, got {sample.ground_truth!r}") from None
        return float(any(int(g) == secret for g in re.findall(r"(-?\d+)\?", sample.response)))
