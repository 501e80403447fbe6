"""Reward role building blocks: the RewardFunction protocol, built-in verifiers, a process pool.

Names are exported lazily (PEP 562): a pool worker process imports this package on its way to
sealrl.rewards.worker and must not pay for sealrl.experience (which imports torch) or for the
reward model. Heavy dependencies load inside the scorer that needs them.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "RewardSample": "base", "RewardFunction": "base", "BatchRewardFunction": "base",
    "RawScore": "base", "Outcome": "base", "check_raw": "base", "score_raw": "base",
    "reward_identity": "base",
    "ArithmeticExactMatch": "verifiers", "CountdownVerifier": "verifiers",
    "MathVerifier": "verifiers", "FormatReward": "verifiers", "WeightedReward": "verifiers",
    "answer_text": "verifiers", "RewardModelScorer": "reward_model", "RewardPool": "pool",
    "CodeExecutionReward": "code", "run_sandboxed": "sandbox", "SandboxResult": "sandbox",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sealrl.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sealrl.rewards.{_EXPORTS[name]}"), name)
