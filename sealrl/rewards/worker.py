"""The body of a RewardPool worker process (launched by sealrl.rewards.pool).

A worker is a fresh interpreter (`python -c`, never a fork: torch + fork is unsafe) that imports
only this module, sealrl.rewards.base and the scorer's own module. Not the driver's __main__ (as
multiprocessing's spawn would) and not sealrl.experience (whose package imports torch): start-up
stays ~0.1 s for a rule-based scorer instead of the seconds a torch import costs.
"""
from __future__ import annotations

import os
import pickle
import resource
import signal
from multiprocessing.connection import Connection

from sealrl.rewards.base import score_raw

# Run by the pool as `python -c BOOTSTRAP <fd> <json sys.path>`: the parent's import roots first,
# so the scorer's module (even one found through a test runner's sys.path) unpickles here.
BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
             "from sealrl.rewards.worker import main; main(int(sys.argv[1]), int(sys.argv[3]))")


def main(fd: int, memory_mb: int = 0) -> None:
    """Receive the pickled scorer, run its optional setup(), then answer requests until stopped.

    Consumes on the connection `fd`: the scorer's pickle (bytes) once, then (request id,
    list[RewardSample]) per request, or None to stop. Sends ("ready", pid) once, then ("done",
    (request id, pid, sample ids, list[Outcome])) per request, which the pool joins only to the
    request it sent with that id; ("startup_error", text) instead of "ready" if the scorer cannot
    start.

    A scorer that forks: a copy that returns from the scorer into this loop exits at once,
    without answering or reading (only this process talks on the pipe), and the children it
    leaves are reaped between requests (no zombies; a child the scorer keeps across requests
    and waits for later gets exit status 0 if it ended between two requests).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the driver, which closes us
    if memory_mb > 0:   # reward.scorer_memory_mb: before the scorer loads anything
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    conn = Connection(fd)
    try:
        fn = pickle.loads(conn.recv())
        setup = getattr(fn, "setup", None)  # optional hook, see RewardFunction
        if setup is not None:
            setup()
    except BaseException as e:
        conn.send(("startup_error", f"{type(e).__name__}: {e}"))
        return
    pid = os.getpid()
    conn.send(("ready", pid))
    # Between requests, children that exit are reaped as they exit; while the scorer runs they
    # are left to it (subprocess reads its own child's exit status).
    idle = lambda *_: _reap_children()
    signal.signal(signal.SIGCHLD, idle)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the driver went away
            return
        if message is None:
            return
        request_id, samples = message
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            outcomes = score_raw(fn, samples)
        finally:
            if os.getpid() != pid:  # a forked copy of this worker: never answer, never read
                os._exit(0)
        conn.send(("done", (request_id, pid, [s.sample_id for s in samples], outcomes)))
        signal.signal(signal.SIGCHLD, idle)
        _reap_children()   # those that exited while the scorer ran


def _reap_children() -> None:
    """Collect every child the scorer left that has exited (forked copies, finished helpers)."""
    while True:
        try:
            child, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:   # no children at all
            return
        if child == 0:              # children left, none exited
            return
