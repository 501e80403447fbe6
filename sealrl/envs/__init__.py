"""Environments for multi-turn episodes (floor 1): the protocol (base.py), tools run in a
worker process under a deadline (tools.py), the calculator (calc.py), a guessing game
(guess.py) and loading by config (load.py). Their outcome verifiers are in
sealrl/rewards/episodes.py; the episode loop that talks to them is sealrl/rollout/episodes.py."""
from sealrl.envs.base import Environment, EnvStep
from sealrl.envs.load import BUILTIN, EnvLoadError, make_env

__all__ = ["Environment", "EnvStep", "BUILTIN", "EnvLoadError", "make_env"]
