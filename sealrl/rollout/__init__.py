"""Rollout: sample responses from one verified policy version (engine.py)."""
from sealrl.rollout.engine import GenerationRequest, RolloutEngine, RolloutSample, VersionNotHeldError

__all__ = ["GenerationRequest", "RolloutEngine", "RolloutSample", "VersionNotHeldError"]
