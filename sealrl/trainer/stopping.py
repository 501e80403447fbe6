"""Graceful stops: SIGTERM (what Slurm, Kubernetes and Ray send before a kill) and SIGINT (Ctrl-C).

The first signal asks the loop to stop: the iteration in flight finishes, a checkpoint is
committed at its end, and the run exits with 128 + the signal number (143 for SIGTERM, 130 for
SIGINT) saying so, so that `resume=auto` continues exactly from there and a supervisor can tell
a requested stop from a failure. A second signal abandons the iteration at once (the previous
checkpoint holds; nothing the iteration wrote is committed).

So the bound on a graceful stop is one iteration plus one checkpoint (a few seconds on the
embedded model; `time/iteration_s` in metrics.jsonl says it for a run). Give the process at
least that as its grace period (Kubernetes' terminationGracePeriodSeconds, Slurm's
`--signal=TERM@<seconds>`), or send the signal twice to stop at once.

Only the main thread can install handlers; elsewhere (a run started from another thread)
signals keep their defaults.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Which signal asked the run to stop, if any (read by the loop between iterations)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def exit_status(self) -> int:
        return 128 + int(self.signal) if self.signal is not None else 0

    def _handle(self, signum: int, _frame) -> None:
        if self.signal is not None:   # the second one: abandon the iteration in flight
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.signal = signal.Signals(signum)
        print(f"\nsealrl: {self.signal.name} received; finishing the current iteration and committing a "
              f"checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)


@contextmanager
def graceful_stop():
    """Install the handlers for the block (main thread only); restore the previous ones after."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, request._handle)
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
