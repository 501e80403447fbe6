"""Fault injection for tests and drills; off unless SEALRL_FAULTS is set.

SEALRL_FAULTS="stage@iteration:action[,...]". Each entry fires once per process, the first time
the driver passes `stage` in `iteration` (checkpoint stages use the checkpoint's step; weight_sync
the iteration whose version it publishes).

stages:  generate, reward, reference, old_log_prob, update (the trace's stage names: the
         trainer's drills.py wraps the roles at these stages when SEALRL_FAULTS is set),
         weight_sync, before_optimizer_step (inside the actor's step), checkpoint_before_marker,
         checkpoint_after_marker, after_checkpoint (the checkpoint writer)
actions: raise          raise InjectedFault (the stage fails; the driver's recovery runs)
         kill           SIGKILL this process (no clean-up at all)
         hang           never return; the stage watchdog (run.stage_timeout_s) ends the process
                        naming the stage, and resume=auto continues from the last checkpoint
         delay=SECONDS  sleep, then go on
         term, int      send SIGTERM / SIGINT to this process, as a supervisor or Ctrl-C would
                        (trainer/stopping.py: the iteration finishes, a checkpoint, exit 143 / 130)
         corrupt        the caller corrupts what it is about to deliver (weight_sync)
         twice          the caller delivers its output twice (generate samples, reward records):
                        the second copy is dropped by its key and counted
         late           the caller's call "misses its deadline" and is retried; its real output
                        arrives after the retry's (generate, reward) and is rejected by key and
                        attempt, and counted
         kill_rank      the caller kills the last data-parallel actor rank's Ray process, as a
                        lost node would, then calls the update (update; placement.actor_ranks > 1)

`point` carries out raise, kill, hang and delay itself and returns the action name, so that a
caller carries out corrupt, twice and late where that stage delivers its output.
"""
from __future__ import annotations

import os
import signal
import time

STAGES = ("generate", "reward", "reference", "old_log_prob", "update", "before_optimizer_step",
          "weight_sync", "checkpoint_before_marker", "checkpoint_after_marker", "after_checkpoint")
ACTIONS = ("raise", "kill", "hang", "delay", "corrupt", "twice", "late", "term", "int", "kill_rank")
# Where a caller carries the action out; elsewhere it would silently do nothing, so it is refused.
DELIVERY = {"corrupt": ("weight_sync",), "twice": ("generate", "reward"), "late": ("generate", "reward"),
            "kill_rank": ("update",)}
_fired: set[str] = set()


class InjectedFault(RuntimeError):
    pass


def _plan() -> dict[tuple[str, int], tuple[str, str]]:
    plan = {}
    for item in filter(None, os.environ.get("SEALRL_FAULTS", "").split(",")):
        where, _, action = item.partition(":")
        stage, _, it = where.partition("@")
        name = action.split("=")[0]
        if stage not in STAGES or name not in ACTIONS or not it.isdigit():
            raise ValueError(f"SEALRL_FAULTS entry {item!r} must be stage@iteration:action with stage in "
                             f"{', '.join(STAGES)} and action raise | kill | hang | delay=SECONDS | corrupt "
                             f"| twice | late | term | int | kill_rank")
        if stage not in DELIVERY.get(name, STAGES):
            raise ValueError(f"SEALRL_FAULTS entry {item!r}: action {name} applies only at stage "
                             f"{' | '.join(DELIVERY[name])}")
        plan[(stage, int(it))] = (item, action)
    return plan


def point(stage: str, iteration: int) -> str:
    """Fire the fault planned here, if any. Returns the action ("" when none fired): the caller
    carries out "corrupt", "twice" and "late" on what it delivers."""
    entry = _plan().get((stage, iteration))
    if entry is None or entry[0] in _fired:
        return ""
    item, action = entry
    _fired.add(item)
    if action in ("kill", "term", "int"):
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}[action])
    if action == "raise":
        raise InjectedFault(f"injected fault at stage {stage}, iteration {iteration}")
    if action == "hang":
        while True:  # only a watchdog or a signal ends this
            time.sleep(3600)
    if action.startswith("delay="):
        time.sleep(float(action.split("=", 1)[1]))
    return action.split("=")[0]
