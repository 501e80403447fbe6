"""One way to run a role in another process of this machine: a process host.

    host = ProcessHost("reward scorer", factory)       # a child builds factory() and serves it
    host.call("score", samples, timeout_s=5)           # a method call with a deadline
    host.submit(...); host.receive(timeout_s=0)        # the same, split (many hosts, one wait())
    host.respawn()                                     # a fresh host from the same factory
    host.close()

Users: the generation lane (placement/process_group.py: a rollout pool of one worker with two
channels, so a weight load never waits for a generation), the reward scorer pool (rewards/pool.py: one
host per scorer, many waited on at once) and the tool worker of multi-turn environments
(envs/tools.py). Roles on other machines run on Ray hosts (placement/workers.py), which keep the
same rule: a host that is gone raises one named error.

What a host guarantees:
- **One named error when it is lost**: HostLostError names the host, its pid and why (exited
  with code N during <call>, missed the deadline of T s during <call> and was killed, could not
  start, sent a reply it was not asked for). The first loss is kept: every later call raises it.
- **Deadlines**: a call that misses its deadline kills the host (its whole process group).
- **Replies are checked**: each carries the call id and the pid of the process that served it; a
  reply from another process (a role that forked, whose copy wrote to the pipe) or for another
  call is refused, and the host is lost (what it holds can no longer be trusted). A forked copy
  that returns from the role into the serving loop exits without answering.
- **A role's own exception** comes back as itself (or its RemoteCallError form) and the host
  serves on.

How: `start="exec"` launches `python -c` on this module (never a fork after torch; unlike
multiprocessing's spawn the child does not re-import the driver's __main__: a light factory
starts in ~0.1 s), with the parent's sys.path so the factory unpickles there; `start="fork"`
forks (fast, no pickling; only for roles that never touch torch, e.g. tools), and the child dies
with the thread that forked it (Linux PR_SET_PDEATHSIG). Either way the child runs in its own
session (a kill takes what it forked with it), ignores Ctrl-C (the parent's), and serves one
channel (a socket pair) per thread: channel 0 on its main thread, the others on their own.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class HostLostError(RuntimeError):
    """A process host is gone or can no longer be trusted. `kind`: exited | deadline | start |
    stray | unreachable."""

    def __init__(self, host: str, pid: int | None, kind: str, reason: str) -> None:
        super().__init__(f"{host} (pid {pid}) {reason}")
        self.host, self.pid, self.kind, self.reason = host, pid, kind, reason

    def __reduce__(self):
        return type(self), (self.host, self.pid, self.kind, self.reason)


class RemoteCallError(Exception):
    """A role's exception that does not survive pickling (custom __init__), sent as its type
    name, message and simple attributes (e.g. WeightSyncError.tensor) so nothing is lost."""

    def __init__(self, type_name: str, message: str, fields: dict) -> None:
        super().__init__(type_name, message, fields)
        self.type_name, self.message, self.fields = type_name, message, fields
        for k, v in fields.items():
            setattr(self, k, v)

    def __str__(self) -> str:
        return self.message

    @classmethod
    def portable(cls, e: BaseException) -> BaseException:
        """`e` itself if it pickles and unpickles, else its RemoteCallError form."""
        try:
            pickle.loads(pickle.dumps(e))
            return e
        except Exception:  # noqa: BLE001 - any failure to round-trip means: send the portable form
            simple = (str, int, float, bool, type(None))
            return cls(type(e).__name__, str(e), {k: v for k, v in vars(e).items() if isinstance(v, simple)})


def type_name_of(e: BaseException) -> str:
    return e.type_name if isinstance(e, RemoteCallError) else type(e).__name__


# Run as `python -c BOOTSTRAP <json sys.path> <json settings>`: the parent's import roots first.
BOOTSTRAP = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
             "from sealrl.seams.host import _exec_child; _exec_child(json.loads(sys.argv[2]))")
_POLL_S = 0.1
HOSTED = False        # True in a host's child process (tests tell the two sides apart by it)
CHANNEL_FDS: list[int] = []   # there: its channels' file descriptors


class ProcessHost:
    """A child process serving `factory()` (see the module doc). `output`: where the child's
    stdout goes (inherit, stderr: the driver's stdout stays its own, null: stdout and stderr);
    `memory_mb`: the child's address-space limit (RLIMIT_AS, 0 = none), set before the factory
    runs; `wait_ready`: False returns at once (`receive` then takes the ready answer, and a
    failed start raises there)."""

    def __init__(self, name: str, factory: Callable[[], Any], *, channels: int = 1, start: str = "exec",
                 output: str = "inherit", memory_mb: int = 0, startup_timeout_s: float = 120.0,
                 wait_ready: bool = True) -> None:
        if start not in ("exec", "fork") or output not in ("inherit", "stderr", "null"):
            raise ValueError(f"ProcessHost: start must be exec or fork and output inherit, stderr or null, "
                             f"got {start!r}, {output!r}")
        payload = pickle.dumps(factory) if start == "exec" else b""   # before anything starts: may raise
        self.name, self.factory, self.channels, self.start = name, factory, channels, start
        self.output, self.memory_mb, self.startup_timeout_s = output, memory_mb, startup_timeout_s
        self.lost: HostLostError | None = None
        self.ready, self.started, self._killed = False, time.monotonic(), False
        self._ids = itertools.count()
        self._expect: list[int | None] = [None] * channels   # the call each channel waits on
        self._locks = [threading.Lock() for _ in range(channels)]
        self._during: list[str | None] = [None] * channels
        pairs = [mp.Pipe(duplex=True) for _ in range(channels)]
        self._conns = [p for p, _ in pairs]
        settings = {"memory_mb": memory_mb, "output": output, "parent": os.getpid()}
        if start == "exec":
            fds = [c.fileno() for _, c in pairs]
            out = {"inherit": None, "stderr": sys.__stderr__.fileno(), "null": subprocess.DEVNULL}[output]
            self._proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP, json.dumps(sys.path), json.dumps({**settings, "fds": fds})],
                pass_fds=fds, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.DEVNULL if output == "null" else None, start_new_session=True)
        else:
            self._proc = mp.get_context("fork").Process(
                target=_fork_child, args=([c for _, c in pairs], factory, settings), daemon=True,
                name=f"sealrl-{name.replace(' ', '-')}")
            self._proc.start()
        for _, child in pairs:
            child.close()   # only the child holds its ends: its death reads as EOF here
        self.pid: int = self._proc.pid
        self.served_by = self.pid   # the pid whose replies count (the child's answer to start)
        if start == "exec":
            try:
                self._conns[0].send_bytes(payload)
            except OSError:
                pass   # it died already: receive reports the start-up failure
        if wait_ready:
            try:
                while not self.ready:
                    self.receive(0, self.startup_timeout_s, "start")
            except BaseException:
                self.close()
                raise

    # ---- calls ---------------------------------------------------------------------------------
    def call(self, method: str, *args, channel: int | None = 0, timeout_s: float, stream: Callable | None = None,
             during: str | None = None, **kwargs) -> Any:
        """`method(*args, **kwargs)` on the role, answered within `timeout_s`; `stream(value)`:
        the role is called with a `stream` function whose values arrive here, in this thread,
        before the answer. Calls on one channel run one after another; `channel=None` takes a
        free one (or waits for channel 0), so up to `channels` calls run at once. `during`: how
        a loss names the call (default: `method`)."""
        channel = self._take(channel)
        try:
            self.submit(method, *args, channel=channel, stream=stream is not None, during=during, **kwargs)
            deadline = time.monotonic() + timeout_s
            while True:
                kind, value = self.receive(channel, max(0.0, deadline - time.monotonic()), during or method,
                                           deadline_s=timeout_s)
                if kind == "stream":
                    stream(value)
                elif kind == "error":
                    raise value
                elif kind == "ok":
                    return value
        finally:
            self._locks[channel].release()

    def _take(self, channel: int | None) -> int:
        if channel is not None:
            self._locks[channel].acquire()
            return channel
        for c, lock in enumerate(self._locks):
            if lock.acquire(blocking=False):
                return c
        self._locks[0].acquire()
        return 0

    def submit(self, method: str, *args, channel: int = 0, stream: bool = False, during: str | None = None,
               **kwargs) -> int:
        """Send one call (its answer comes from `receive`); returns its id."""
        during = during or method
        self._check()
        call_id = next(self._ids)
        try:
            self._conns[channel].send((call_id, method, args, kwargs, stream))
        except (OSError, ValueError) as e:
            if self.exitcode(wait_s=5.0) is not None:   # a broken pipe: the process is gone
                self._lose("exited", f"exited with code {self.exitcode()} before {during}")
            self._lose("unreachable", f"cannot be reached for {during} ({type(e).__name__}: {e})")
        self._expect[channel], self._during[channel] = call_id, during
        return call_id

    def receive(self, channel: int = 0, timeout_s: float = 0.0, during: str | None = None,
                deadline_s: float | None = None) -> tuple[str, Any]:
        """The next message of `channel` within `timeout_s`: ("ok" | "error" | "stream", value),
        or ("ready", pid) at start, or ("none", None) if nothing came and the call still has time.
        With `deadline_s` (the call's deadline), nothing by then kills the host and raises."""
        self._check()
        during = during or self._during[channel] or "a call"
        conn, end = self._conns[channel], time.monotonic() + timeout_s
        while not conn.poll(min(_POLL_S, max(0.0, end - time.monotonic()))):
            if self.exitcode() is not None:
                break   # exited: the EOF below names it (its last answer may still be in the pipe)
            if time.monotonic() >= end:
                if deadline_s is not None:
                    self.kill()
                    self._lose("deadline", f"missed the deadline of {deadline_s:g} s during {during}; it was killed")
                if not self.ready and time.monotonic() > self.started + self.startup_timeout_s:
                    self.kill()
                    self._lose("start", f"did not start within {self.startup_timeout_s:g} s")
                return "none", None
        try:
            kind, call_id, pid, value = conn.recv()
        except (EOFError, OSError):
            self._lose("exited", f"exited with code {self.exitcode(wait_s=5.0)} during {during}")
        if kind == "ready":
            self.ready, self.served_by = True, pid
            return kind, pid
        if kind == "start_error":   # the role's own exception, kept as the cause
            self.kill()
            self._lose("start", f"could not start: {type_name_of(value)}: {value}", cause=value)
        if pid != self.served_by or call_id != self._expect[channel]:
            self.kill()
            self._lose("stray", f"sent a reply it was not asked for (call {call_id} from pid {pid}, waiting for "
                       f"call {self._expect[channel]} from pid {self.served_by}; did the role fork?) during {during}")
        if kind != "stream":
            self._expect[channel] = self._during[channel] = None
        return kind, value

    def connection(self, channel: int = 0) -> Connection:
        """The channel's end here, for multiprocessing.connection.wait over many hosts."""
        return self._conns[channel]

    @property
    def busy(self) -> bool:
        return any(e is not None for e in self._expect)

    # ---- life ----------------------------------------------------------------------------------
    def exitcode(self, wait_s: float = 0.0) -> int | None:
        """The child's exit code once it has exited (within `wait_s`), else None."""
        deadline = time.monotonic() + wait_s
        while True:
            code = self._proc.poll() if self.start == "exec" else self._proc.exitcode
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the child's session (what it forked dies with it) and reap it; once."""
        if self._killed:
            return
        self._killed = True
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.start == "exec":
            self._proc.kill()
            self._proc.wait()
        else:
            self._proc.kill()
            self._proc.join()

    def close(self, grace_s: float = 5.0) -> None:
        """Ask the child to stop (idle channels end its loops), kill it after `grace_s`; idempotent."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        if self.exitcode(wait_s=grace_s if not self.busy else 0.0) is None:
            self.kill()
        self.exitcode(wait_s=5.0)
        for conn in self._conns:
            conn.close()

    def respawn(self, wait_ready: bool = True) -> "ProcessHost":
        """This host killed, and a fresh one from the same factory and settings (replacement)."""
        self.close(grace_s=0.0)
        return ProcessHost(self.name, self.factory, channels=self.channels, start=self.start, output=self.output,
                           memory_mb=self.memory_mb, startup_timeout_s=self.startup_timeout_s,
                           wait_ready=wait_ready)

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def _lose(self, kind: str, reason: str, cause: BaseException | None = None):
        """Raise the host's loss; the first found (by any channel's caller) is kept."""
        if self.lost is None:
            self.lost = HostLostError(self.name, self.pid, kind, reason)
            self.lost.__cause__ = cause
        raise self.lost


# ---- the child ------------------------------------------------------------------------------------

def _exec_child(settings: dict) -> None:
    conns = [Connection(fd) for fd in settings["fds"]]
    _limit(settings)
    try:
        factory = pickle.loads(conns[0].recv_bytes())
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        conns[0].send(("start_error", -1, os.getpid(), RemoteCallError.portable(e)))
        return
    _serve(conns, factory)


def _fork_child(conns: list[Connection], factory: Callable, settings: dict) -> None:
    os.setsid()
    if sys.platform == "linux":   # dies with the thread that forked it: no child keeps its sockets
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    if os.getppid() != settings["parent"]:
        os._exit(0)
    if settings["output"] == "null":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    _limit(settings)
    _serve(conns, factory)


def _limit(settings: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C belongs to the parent, which closes us
    if settings["memory_mb"] > 0:   # before the factory loads anything
        import resource
        limit = settings["memory_mb"] << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _serve(conns: list[Connection], factory: Callable) -> None:
    """Build the role, say ready (or why not), serve every channel until told to stop or the
    parent's end closes; then close the role and exit without the interpreter's slow teardown."""
    global HOSTED, CHANNEL_FDS
    HOSTED, CHANNEL_FDS = True, [c.fileno() for c in conns]
    pid = os.getpid()
    try:
        role = factory()
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it
        conns[0].send(("start_error", -1, pid, RemoteCallError.portable(e)))
        os._exit(0)
    conns[0].send(("ready", -1, pid, None))
    for conn in conns[1:]:
        threading.Thread(target=_loop, args=(role, conn, pid), daemon=True, name="sealrl-channel").start()
    try:
        _loop(role, conns[0], pid)
    finally:
        close = getattr(role, "close", None)
        if close is not None:
            close()
    os._exit(0)


def _loop(role, conn: Connection, pid: int) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, method, args, kwargs, streamed = msg
        if streamed:
            kwargs["stream"] = _streamer(conn, call_id, pid)
        try:
            out = ("ok", call_id, pid, getattr(role, method)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the role's own error, raised in the parent
            out = ("error", call_id, pid, RemoteCallError.portable(e))
        finally:
            if os.getpid() != pid:   # a forked copy of this process returned here: never answer
                os._exit(0)
        try:
            conn.send(out)
        except (OSError, ValueError):
            return


def _streamer(conn: Connection, call_id: int, pid: int) -> Callable:
    """What a streamed call's role calls with each value (an empty one is not sent)."""
    def stream(value) -> None:
        if value:
            conn.send(("stream", call_id, pid, value))
    return stream
