"""The remote-host conformance suite (seams/host.py, placement/workers.py): every way sealrl runs
a role elsewhere keeps the same rules.

- a call answers, and the role's own exception comes back as itself while the host serves on;
- a call past its deadline ends the host, and the error says so;
- a host killed from outside is named (which host, which call);
- a role that cannot be built is raised at start, with the role's own error;
- a lost host is replaced by a fresh one from the same factory, which serves again.

Hosts: a process host launched with exec (the generation lane, the reward scorers) and with fork
(the tool worker), and a Ray host (one worker of a RayWorkerGroup; slow: Ray's start-up). The
process hosts also refuse a reply they were not asked for (a role that forked).
"""
from __future__ import annotations

import functools
import os
import re
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest

from sealrl.seams import host as host_module
from sealrl.seams.host import HostLostError, ProcessHost
from tests.harness import local_ray


class Echo:
    """A role: echoes, fails on request, sleeps, streams, forges a reply."""

    def __init__(self, fail_at_start: bool = False) -> None:
        if fail_at_start:
            raise FileNotFoundError("no model folder /nowhere")
        self.pid = os.getpid()

    def echo(self, x):
        return x

    def fail(self, text: str):
        raise ValueError(text)

    def sleep(self, s: float):
        time.sleep(s)
        return s

    def count(self, n: int, stream):
        for i in range(n):
            stream([i])
        return n

    def forge(self) -> str:
        """Write a reply for a call never made onto this host's pipe, as a second process
        holding it would, then answer."""
        conn = Connection(host_module.CHANNEL_FDS[0], readable=False)
        conn.send(("ok", 10**6, os.getpid(), "forged"))
        conn._handle = None   # not ours to close
        return "real"


@dataclass
class Kind:
    name: str
    make: object        # (fail_at_start) -> host
    call: object        # (host, method, *args, timeout_s) -> value
    kill: object        # (host) -> None
    lost: type          # the named error
    pid: object         # (host) -> the role's pid


def _process(start):
    def make(fail_at_start=False):
        return ProcessHost(f"{start} host", functools.partial(Echo, fail_at_start), start=start, startup_timeout_s=60)
    return Kind(start, make, lambda h, m, *a, timeout_s=30: h.call(m, *a, timeout_s=timeout_s),
                lambda h: os.kill(h.pid, signal.SIGKILL), HostLostError, lambda h: h.pid)


def _ray():
    from sealrl.placement.workers import RayPool, RayWorkerGroup, WorkerError, pools_from_config

    def make(fail_at_start=False):
        pool = RayPool(pools_from_config({"h": {"roles": ["echo"], "num_workers": 1}})["echo"], timeout_s=60)
        group = RayWorkerGroup("echo", functools.partial(Echo, fail_at_start), pool, timeout_s=60)
        group.ray_pool = pool
        return group

    def kill(group):
        """As os.kill for a process host: returns once the actor is dead (ray.kill is asynchronous:
        a call sent at once may still be served)."""
        import ray
        actor = group.actors[0]
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ray.get(actor.attr.remote("__class__"), timeout=5)
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:
                pass
            time.sleep(0.1)
    return Kind("ray", make, lambda g, m, *a, timeout_s=30: g.call(m, *a, timeout_s=timeout_s)[0], kill,
                WorkerError, lambda g: g.attr("pid")[0])


KINDS = [pytest.param(_process("exec"), id="exec"), pytest.param(_process("fork"), id="fork"),
         pytest.param(_ray(), id="ray", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def ray_session():
    """The process's shared local Ray (tests/harness.py) for the module's Ray cases (each places
    and removes its own pool)."""
    local_ray()


@pytest.fixture(params=KINDS)
def kind(request):
    if request.param.name == "ray":
        request.getfixturevalue("ray_session")
    return request.param


def _close(host) -> None:
    host.close()
    if hasattr(host, "ray_pool"):
        host.ray_pool.close()


def test_a_call_answers_and_the_roles_own_error_comes_back_as_itself(kind):
    host = kind.make()
    try:
        assert kind.call(host, "echo", {"a": (1, 2.5)}) == {"a": (1, 2.5)}
        with pytest.raises(Exception, match="bad request 7") as e:
            kind.call(host, "fail", "bad request 7")
        cause = getattr(e.value, "cause", e.value)   # a Ray host wraps it in WorkerError
        assert isinstance(cause, ValueError) and not getattr(e.value, "lost", False)
        assert kind.call(host, "echo", 3) == 3    # and serves on
    finally:
        _close(host)


def test_a_call_past_its_deadline_ends_the_host_and_says_so(kind):
    host = kind.make()
    try:
        t0 = time.monotonic()
        with pytest.raises(kind.lost, match=r"(missed the deadline of 2 s during sleep|no result within 2)") as e:
            kind.call(host, "sleep", 60.0, timeout_s=2)
        assert time.monotonic() - t0 < 10
        if kind.lost is HostLostError:
            assert e.value.kind == "deadline" and host.exitcode(wait_s=5) == -signal.SIGKILL
            with pytest.raises(HostLostError) as again:   # every later call: the same error
                kind.call(host, "echo", 1)
            assert again.value is e.value
        else:
            assert e.value.lost
    finally:
        _close(host)


def test_a_host_killed_from_outside_is_named(kind):
    host = kind.make()
    try:
        pid = kind.pid(host)
        kind.kill(host)
        with pytest.raises(kind.lost) as e:
            kind.call(host, "echo", 1)
        if kind.lost is HostLostError:
            # "before": the process was gone before the call was sent (its pipe already broken,
            # as on a loaded machine); "during": it was sent, and the process never answered
            assert re.fullmatch(rf"{kind.name} host \(pid {pid}\) exited with code -9 (before|during) echo",
                                str(e.value)), str(e.value)
        else:
            assert e.value.lost and "role echo worker 0: echo: the worker's process died" in str(e.value)
    finally:
        _close(host)


def test_a_role_that_cannot_be_built_is_raised_at_start_with_its_own_error(kind):
    with pytest.raises((HostLostError, Exception), match="no model folder /nowhere") as e:
        kind.make(fail_at_start=True)
    if kind.lost is HostLostError:
        assert e.value.kind == "start" and isinstance(e.value.__cause__, FileNotFoundError)
        with pytest.raises(ProcessLookupError):   # killed and reaped
            os.kill(e.value.pid, 0)


def test_a_lost_host_is_replaced_by_a_fresh_one_that_serves(kind):
    host = kind.make()
    try:
        first = kind.pid(host)
        kind.kill(host)
        with pytest.raises(kind.lost):
            kind.call(host, "echo", 1)
        if kind.lost is HostLostError:
            host = host.respawn()
        else:
            host.restart(0)
        assert kind.call(host, "echo", 2) == 2 and kind.pid(host) != first
    finally:
        _close(host)


@pytest.mark.parametrize("start", ["exec", "fork"])
def test_a_process_host_streams_and_refuses_a_reply_it_was_not_asked_for(start):
    host = _process(start).make()
    try:
        got = []
        assert host.call("count", 3, timeout_s=30, stream=got.append) == 3 and got == [[0], [1], [2]]
        with pytest.raises(HostLostError, match=r"sent a reply it was not asked for \(call 1000000 from pid") as e:
            host.call("forge", timeout_s=30)
        assert e.value.kind == "stray" and host.exitcode(wait_s=5) is not None   # killed: it cannot be trusted
    finally:
        host.close()
