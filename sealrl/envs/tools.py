"""Tools as an environment: the policy emits a tagged call, a worker process runs the tool
under a deadline, and its output comes back as the observation.

Call format: `<name>arguments</name>`; the closing tag of every registered tool is a stop
string, so the policy's turn ends at the token that completes it. The observation is
`<out>result</out>` (or `<out>error: ...</out>`); a turn that ends without a call (eos) ends
the episode.

Failures are named, never rewards (experience/episode.py EnvStatus): a tool that raises is
ERROR, one past `timeout_s` is TIMEOUT (its worker is killed and a fresh one started on the next
call, so nothing hangs), one that returns more than `max_output_chars` is FLOOD (cut, marked), a
call naming no tool is BAD_CALL. Tools are plain functions str -> str; the worker is a process
host (seams/host.py) forked once and reused (a pipe per call, about 0.1 ms), its stdout and
stderr go to /dev/null, it dies with the thread that forked it (Linux: PR_SET_PDEATHSIG), and it
imports nothing new (fork after torch is safe as long as the tool itself does not use torch).
Code-like tools that must not be trusted belong in sealrl.rewards.sandbox instead: this worker
isolates time and output, not the file system.
"""
from __future__ import annotations

import functools
import re
from typing import Callable

from sealrl.envs.base import EnvStep
from sealrl.experience.episode import EnvStatus
from sealrl.seams.host import HostLostError, ProcessHost

Tool = Callable[[str], str]


class _Tools:
    """What the worker process serves: (status, output, message) per call."""

    def __init__(self, tools: dict[str, Tool], max_output_chars: int) -> None:
        self.tools, self.max_output_chars = tools, max_output_chars

    def run(self, name: str, args: str) -> tuple[str, str, str]:
        try:
            out = str(self.tools[name](args))
        except Exception as e:  # noqa: BLE001 - a tool's failure is its status, reported back
            return "error", "", f"{type(e).__name__}: {e}"[:200]
        if len(out) > self.max_output_chars:
            return "flood", out[:self.max_output_chars], f"output of {len(out)} chars cut to {self.max_output_chars}"
        return "ok", out, ""


class ToolWorker:
    """One forked process host (seams/host.py) that runs tools, with a deadline per call."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, max_output_chars: int) -> None:
        self.tools, self.timeout_s, self.max_output_chars = dict(tools), timeout_s, max_output_chars
        self.host: ProcessHost | None = None

    def call(self, name: str, args: str) -> tuple[EnvStatus, str, str]:
        """(status, output, message). Never raises for anything the tool does."""
        if self.host is None:
            self.host = ProcessHost("tool worker", functools.partial(_Tools, self.tools, self.max_output_chars),
                                    start="fork", output="null")
        elif self.host.lost is not None or self.host.exitcode() is not None:
            self.host = self.host.respawn()
        try:
            status, out, msg = self.host.call("run", name, args, timeout_s=self.timeout_s)
        except HostLostError as e:   # killed at the deadline, or died: the next call starts a fresh one
            if e.kind == "deadline":
                return EnvStatus.TIMEOUT, "", f"tool {name!r} did not answer within {self.timeout_s} s"
            return EnvStatus.ERROR, "", f"tool worker died ({e.reason})"
        return EnvStatus(status), out, msg

    def close(self) -> None:
        if self.host is not None:
            self.host.close(grace_s=0.0)
        self.host = None


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
