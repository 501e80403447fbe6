"""Rollout: sample responses from one verified policy version (engine.py). The wire types it
speaks (requests, samples) live in sealrl/experience/wire.py; the protocol every rollout client
meets in client.py."""
from sealrl.rollout.engine import RolloutEngine

__all__ = ["RolloutEngine"]
