"""Fault injection for tests and drills, off unless SEALRL_FAULTS is set.

SEALRL_FAULTS="stage@iteration:action[,...]", e.g. "after_checkpoint@3:kill" kills the process
(SIGKILL, no clean-up) right after checkpoint 3 is committed; "actor_update@2:raise" raises
InjectedFault there. Stages are the names passed to `point()` by the driver."""
from __future__ import annotations

import os
import signal

ACTIONS = ("raise", "kill")


class InjectedFault(RuntimeError):
    pass


def _plan() -> dict[tuple[str, int], str]:
    plan = {}
    for item in filter(None, os.environ.get("SEALRL_FAULTS", "").split(",")):
        where, _, action = item.partition(":")
        stage, _, it = where.partition("@")
        if action not in ACTIONS or not it.lstrip("-").isdigit():
            raise ValueError(f"SEALRL_FAULTS entry {item!r} must look like stage@iteration:{'|'.join(ACTIONS)}")
        plan[(stage, int(it))] = action
    return plan


def point(stage: str, iteration: int) -> None:
    action = _plan().get((stage, iteration))
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise InjectedFault(f"injected fault at {stage}@{iteration}")
