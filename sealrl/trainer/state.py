"""The iteration state machine of DESIGN section 1: a transition is legal only from the phase
before it; anything else is a bug in the driver and raises IllegalTransition. Timing and the
trace are obs/timeline.py's; the deadline of each stage is watchdog.py's."""
from __future__ import annotations

import enum

from sealrl.config import UserError


class Phase(str, enum.Enum):
    ACTOR_COMMITTED = "ACTOR_COMMITTED"
    EXPORTING = "EXPORTING"
    ROLLOUT_LOADING = "ROLLOUT_LOADING"
    ROLLOUT_READY = "ROLLOUT_READY"
    GENERATING = "GENERATING"
    EXPERIENCE_SEALED = "EXPERIENCE_SEALED"
    UPDATING_FROM = "UPDATING_FROM"


_ORDER = list(Phase)
# ACTOR_COMMITTED(v+1) follows UPDATING_FROM(v); the cycle then repeats.
_NEXT = {p: _ORDER[(i + 1) % len(_ORDER)] for i, p in enumerate(_ORDER)}


class IllegalTransition(RuntimeError):
    """The driver tried a transition the state machine does not have: a bug, never a user error."""


class StageFailed(UserError, RuntimeError):
    """A stage failed past its retries (every group dropped, an update that kept failing): the
    run stops, named, at the last committed checkpoint; resume=auto continues from there."""


class StateMachine:
    def __init__(self) -> None:
        self.phase, self.version = Phase.ACTOR_COMMITTED, ""

    def to(self, phase: Phase, version: str) -> None:
        if _NEXT[self.phase] is not phase:
            raise IllegalTransition(f"{self.phase.value}({self.version}) -> {phase.value}({version}) "
                                    f"is not a transition of the iteration state machine")
        self.phase, self.version = phase, version
