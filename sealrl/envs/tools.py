"""Tools as an environment: the policy emits a tagged call, a worker process runs the tool
under a deadline, and its output comes back as the observation.

Call format: `<name>arguments</name>`; the closing tag of every registered tool is a stop
string, so the policy's turn ends at the token that completes it. The observation is
`<out>result</out>` (or `<out>error: ...</out>`); a turn that ends without a call (eos) ends
the episode.

Failures are named, never rewards (experience/episode.py EnvStatus): a tool that raises is
ERROR, one past `timeout_s` is TIMEOUT (its worker is killed and a fresh one started on the next
call, so nothing hangs), one that returns more than `max_output_chars` is FLOOD (cut, marked), a
call naming no tool is BAD_CALL. Tools are plain functions str -> str; the worker is forked
once and reused (a pipe per call, about 0.1 ms), its stdout and stderr go to /dev/null, it dies
with the process that forked it (Linux: PR_SET_PDEATHSIG), and it imports nothing new (fork
after torch is safe as long as the tool itself does not use torch).
Code-like tools that must not be trusted belong in sealrl.rewards.sandbox instead: this worker
isolates time and output, not the file system.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
import signal
import sys
from typing import Callable

from sealrl.envs.base import EnvStep
from sealrl.experience.episode import EnvStatus

Tool = Callable[[str], str]


def _die_with(parent: int) -> None:
    """Linux: this worker is SIGKILLed when the thread that forked it ends, so a process killed
    at once (a Ray replica whose node is lost) leaves no child holding the sockets it inherited,
    which would hide that death from Ray until the call's deadline. If the parent is already
    gone, exit now. (A worker whose forking thread ended is started again by the next call.)"""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(0)


def _serve(conn, tools: dict[str, Tool], max_output_chars: int, parent: int) -> None:
    """The worker's loop: (name, args) in, (status, output, message) out; None ends it."""
    _die_with(parent)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        name, args = msg
        try:
            out = str(tools[name](args))
        except Exception as e:  # noqa: BLE001 - a tool's failure is its status, reported back
            conn.send(("error", "", f"{type(e).__name__}: {e}"[:200]))
            continue
        if len(out) > max_output_chars:
            conn.send(("flood", out[:max_output_chars], f"output of {len(out)} chars cut to {max_output_chars}"))
        else:
            conn.send(("ok", out, ""))


class ToolWorker:
    """One forked process that runs tools, with a deadline per call."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, max_output_chars: int) -> None:
        self.tools, self.timeout_s, self.max_output_chars = dict(tools), timeout_s, max_output_chars
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.tools, self.max_output_chars, os.getpid()),
                                 daemon=True, name="sealrl-tools")
        self._proc.start()
        child.close()
        self._conn = parent

    def call(self, name: str, args: str) -> tuple[EnvStatus, str, str]:
        """(status, output, message). Never raises for anything the tool does."""
        if self._proc is None or not self._proc.is_alive():
            self.close()
            self._start()
        try:
            self._conn.send((name, args))
            if not self._conn.poll(self.timeout_s):
                self.close()   # killed: the next call starts a fresh worker
                return EnvStatus.TIMEOUT, "", f"tool {name!r} did not answer within {self.timeout_s} s"
            status, out, msg = self._conn.recv()
        except (EOFError, OSError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            self.close()
            return EnvStatus.ERROR, "", f"tool worker died ({type(e).__name__}, exit code {code})"
        return EnvStatus(status), out, msg

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None


class ToolEnv:
    """An environment whose only answers are tool results. Options: `tools` (name -> function),
    `timeout_s` per call, `max_output_chars` before a result counts as a flood."""

    name = "tools"
    version = "1"

    def __init__(self, tools: dict[str, Tool], timeout_s: float = 2.0, max_output_chars: int = 64) -> None:
        bad = [n for n in tools if not re.fullmatch(r"[a-z][a-z0-9_]*", n)]
        if bad:
            raise ValueError(f"tool names must match [a-z][a-z0-9_]*, got {bad}")
        self.stops = tuple(f"</{n}>" for n in tools)
        self._call = re.compile(r"<(" + "|".join(map(re.escape, tools)) + r")>(.*)</\1>\s*$", re.S)
        self.worker = ToolWorker(tools, timeout_s, max_output_chars)

    def reset(self, prompt) -> None:
        return None

    def step(self, state, turn_text: str) -> EnvStep:
        if not turn_text.rstrip().endswith(self.stops):
            return EnvStep(done=True, status=EnvStatus.NONE)   # no call: the policy answered
        m = self._call.search(turn_text)
        if m is None:
            return EnvStep("<out>error: bad call</out>", status=EnvStatus.BAD_CALL,
                           message="a closing tag without its opening tag")
        name, args = m.group(1), m.group(2)
        status, out, msg = self.worker.call(name, args)
        text = f"<out>{out}</out>" if status in (EnvStatus.OK, EnvStatus.FLOOD) else f"<out>error: {status.value}</out>"
        return EnvStep(text, status=status, tool=name, message=msg)

    def close(self) -> None:
        self.worker.close()
