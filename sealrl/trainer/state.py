"""The iteration state machine of DESIGN section 1, as a guard: a transition is legal only from
the phase before it and only for the version that phase holds; anything else is a bug in the
driver and raises IllegalTransition naming both ends. Timing and the trace are
obs/timeline.py's; the deadline of each stage is watchdog.py's.

    ACTOR_COMMITTED(c) -> EXPORTING(v) -> ROLLOUT_LOADING(v) -> ROLLOUT_READY(v)
      [-> CHECKPOINT_DURABLE(k)] -> GENERATING(v) -> EXPERIENCE_SEALED(v) -> UPDATING_FROM(v)
      -> ACTOR_COMMITTED(c')

`c` is the committed actor's version id before its weights are hashed (`run@step.attempt`); the
export's `v` must be that version (`run@step.attempt#hash`). GENERATING, EXPERIENCE_SEALED and
UPDATING_FROM carry the version ROLLOUT_READY made active. ACTOR_COMMITTED(c') from
UPDATING_FROM(v) names the new version; when no optimizer step was taken (all skipped) c' is
v's own id and nothing is published: the next phase is GENERATING(v) again. A committed
checkpoint is CHECKPOINT_DURABLE(k), entered when the rollout serves the committed version.

With `rollout.max_staleness = k` (trainer/pipeline.py) generation runs ahead in its own lane and
GENERATING(v) here marks the trainer taking in the experience of v: v must be one of the last
k + 1 versions ROLLOUT_READY made active (k = 0: the active one, the synchronous rule).
EXPERIENCE_SEALED and UPDATING_FROM carry that same v, the version that sampled the batch.
"""
from __future__ import annotations

import enum
from collections import deque

from sealrl.config import UserError


class Phase(str, enum.Enum):
    ACTOR_COMMITTED = "ACTOR_COMMITTED"
    EXPORTING = "EXPORTING"
    ROLLOUT_LOADING = "ROLLOUT_LOADING"
    ROLLOUT_READY = "ROLLOUT_READY"
    CHECKPOINT_DURABLE = "CHECKPOINT_DURABLE"
    GENERATING = "GENERATING"
    EXPERIENCE_SEALED = "EXPERIENCE_SEALED"
    UPDATING_FROM = "UPDATING_FROM"


P = Phase
_NEXT = {
    P.ACTOR_COMMITTED: (P.EXPORTING, P.GENERATING, P.CHECKPOINT_DURABLE),  # the last two: nothing new
    P.EXPORTING: (P.ROLLOUT_LOADING,),
    P.ROLLOUT_LOADING: (P.ROLLOUT_READY,),
    P.ROLLOUT_READY: (P.GENERATING, P.CHECKPOINT_DURABLE),
    P.CHECKPOINT_DURABLE: (P.GENERATING,),
    P.GENERATING: (P.EXPERIENCE_SEALED,),
    P.EXPERIENCE_SEALED: (P.UPDATING_FROM,),
    P.UPDATING_FROM: (P.ACTOR_COMMITTED,),
}


class IllegalTransition(RuntimeError):
    """The driver tried a transition the state machine does not have: a bug, never a user error."""


class StageFailed(UserError, RuntimeError):
    """A stage failed past its retries (every group dropped, an update that kept failing): the
    run stops, named, at the last committed checkpoint; resume=auto continues from there."""


def committed_id(version_id: str) -> str:
    """`run@step.attempt` of a version id `run@step.attempt#hash`."""
    return version_id.split("#", 1)[0]


class StateMachine:
    def __init__(self, committed: str = "", max_staleness: int = 0) -> None:
        self.phase = Phase.ACTOR_COMMITTED
        self.committed = committed   # c of the last ACTOR_COMMITTED ("" = any: the run's start)
        self.version = ""            # v of the last EXPORTING .. UPDATING_FROM
        self.active = ""             # the version the rollout serves (ROLLOUT_READY)
        self.recent: deque[str] = deque(maxlen=max_staleness + 1)   # the last k + 1 actives

    def to(self, phase: Phase, version: str) -> None:
        """Enter `phase` for `version` (for CHECKPOINT_DURABLE: the checkpoint's step)."""
        problem = self._problem(phase, version)
        if problem:
            raise IllegalTransition(f"{self.phase.value}({self.version or self.committed}) -> "
                                    f"{phase.value}({version}): {problem}")
        if phase is P.ACTOR_COMMITTED:
            self.committed = version
        elif phase is not P.CHECKPOINT_DURABLE:
            self.version = version
            if phase is P.ROLLOUT_READY:
                self.active = version
                self.recent.append(version)
        self.phase = phase

    def recall(self, versions: list[str]) -> None:
        """Resume of an asynchronous run: versions activated before the checkpoint that the
        generation lane still samples from (re-loaded from it, trainer/resume/retained.py), oldest
        first; the version published next becomes the active one after them."""
        self.recent.extend(versions)

    def _problem(self, phase: Phase, version: str) -> str:
        if phase not in _NEXT[self.phase]:
            return "not a transition of the iteration state machine"
        if phase is P.EXPORTING and self.committed and committed_id(version) != self.committed:
            return f"the export is not the committed version {self.committed}"
        if phase in (P.ROLLOUT_LOADING, P.ROLLOUT_READY) and version != self.version:
            return f"another version than the one being exported ({self.version})"
        if phase is P.GENERATING and version not in self.recent:
            lag = f" or the {self.recent.maxlen - 1} before it" if self.recent.maxlen > 1 else ""
            return f"the rollout serves {self.active or 'nothing'}{lag}, not this version"
        if phase in (P.EXPERIENCE_SEALED, P.UPDATING_FROM) and version != self.version:
            return f"the experience was generated by {self.version}"
        if self.phase is P.ACTOR_COMMITTED and phase in (P.GENERATING, P.CHECKPOINT_DURABLE) \
                and self.committed != committed_id(self.active):
            return f"a new version {self.committed} was committed: it must be published first"
        return ""
