"""The body of a RewardPool worker process (launched by sealrl.rewards.pool).

A worker is a fresh interpreter (`python -c`, never a fork: torch + fork is unsafe) that imports
only this module, sealrl.rewards.base and the scorer's own module. Not the driver's __main__ (as
multiprocessing's spawn would) and not sealrl.experience (whose package imports torch): start-up
stays ~0.1 s for a rule-based scorer instead of the seconds a torch import costs.
"""
from __future__ import annotations

import os
import pickle
import signal
from multiprocessing.connection import Connection

from sealrl.rewards.base import score_raw

# Run by the pool as `python -c BOOTSTRAP <fd> <json sys.path>`: the parent's import roots first,
# so the scorer's module (even one found through a test runner's sys.path) unpickles here.
BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
             "from sealrl.rewards.worker import main; main(int(sys.argv[1]))")


def main(fd: int) -> None:
    """Receive the pickled scorer, run its optional setup(), then answer requests until stopped.

    Consumes on the connection `fd`: the scorer's pickle (bytes) once, then a list[RewardSample]
    per request, or None to stop. Sends ("ready", pid) once, then ("done", list[Outcome]) per
    request; ("startup_error", text) instead of "ready" if the scorer cannot start.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the driver, which closes us
    conn = Connection(fd)
    try:
        fn = pickle.loads(conn.recv())
        setup = getattr(fn, "setup", None)  # optional hook, see RewardFunction
        if setup is not None:
            setup()
    except BaseException as e:
        conn.send(("startup_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the driver went away
            return
        if request is None:
            return
        conn.send(("done", score_raw(fn, request)))
