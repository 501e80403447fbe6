"""What a RewardPool worker process serves (launched by sealrl.rewards.pool as a process host,
seams/host.py).

A worker is a fresh interpreter (`python -c`, never a fork: torch + fork is unsafe) that imports
only the host, this module, sealrl.rewards.base and the scorer's own module. Not the driver's
__main__ (as multiprocessing's spawn would) and not sealrl.experience (whose package imports
torch): start-up stays ~0.1 s for a rule-based scorer instead of the seconds a torch import costs.
"""
from __future__ import annotations

import os
import signal

from sealrl.rewards.base import score_raw


class Scorer:
    """The scorer, set up once (its optional setup()), answering score(samples) with (sample
    ids, outcomes).

    A scorer that forks: a copy that returns from the scorer exits at once, without answering
    (the host's loop), and the children it leaves are reaped between requests (no zombies; a child
    the scorer keeps across requests and waits for later gets exit status 0 if it ended between
    two requests).
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        setup = getattr(fn, "setup", None)  # optional hook, see RewardFunction
        if setup is not None:
            setup()
        self._idle()

    def score(self, samples) -> tuple[list[str], list]:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # while the scorer runs, its children are its own
        outcomes = score_raw(self.fn, samples)
        self._idle()
        return [s.sample_id for s in samples], outcomes

    def _idle(self) -> None:
        """Between requests, children that exit are reaped as they exit (and those that exited
        while the scorer ran, now)."""
        signal.signal(signal.SIGCHLD, lambda *_: _reap_children())
        _reap_children()


def _reap_children() -> None:
    """Collect every child the scorer left that has exited (forked copies, finished helpers)."""
    while True:
        try:
            child, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:   # no children at all
            return
        if child == 0:              # children left, none exited
            return
