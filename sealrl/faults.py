"""Fault injection for tests and drills; off unless SEALRL_FAULTS is set.

SEALRL_FAULTS="stage@iteration:action[,...]". Each entry fires once per process, the first time
the driver passes `stage` in `iteration` (checkpoint stages use the checkpoint's step).

stages:  rollout, reward, reference, old_log_prob, actor_update, before_optimizer_step,
         weight_sync, checkpoint_before_marker, checkpoint_after_marker, after_checkpoint
actions: raise          raise InjectedFault (the stage fails; the driver's recovery runs)
         kill           SIGKILL this process (no clean-up at all)
         delay=SECONDS  sleep, then go on
         corrupt        the caller corrupts what it is about to deliver (weight sync only)
"""
from __future__ import annotations

import os
import signal
import time

STAGES = ("rollout", "reward", "reference", "old_log_prob", "actor_update", "before_optimizer_step",
          "weight_sync", "checkpoint_before_marker", "checkpoint_after_marker", "after_checkpoint")
_fired: set[str] = set()


class InjectedFault(RuntimeError):
    pass


def _plan() -> dict[tuple[str, int], tuple[str, str]]:
    plan = {}
    for item in filter(None, os.environ.get("SEALRL_FAULTS", "").split(",")):
        where, _, action = item.partition(":")
        stage, _, it = where.partition("@")
        name = action.split("=")[0]
        if stage not in STAGES or name not in ("raise", "kill", "delay", "corrupt") or not it.isdigit():
            raise ValueError(f"SEALRL_FAULTS entry {item!r} must be stage@iteration:action with stage in "
                             f"{', '.join(STAGES)} and action raise | kill | delay=SECONDS | corrupt")
        plan[(stage, int(it))] = (item, action)
    return plan


def point(stage: str, iteration: int) -> bool:
    """Fire the fault planned here, if any. Returns True when the caller must corrupt its output."""
    entry = _plan().get((stage, iteration))
    if entry is None or entry[0] in _fired:
        return False
    item, action = entry
    _fired.add(item)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise InjectedFault(f"injected fault at stage {stage}, iteration {iteration}")
    if action.startswith("delay="):
        time.sleep(float(action.split("=", 1)[1]))
    return action == "corrupt"
