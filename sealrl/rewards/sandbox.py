"""Run untrusted Python (model-written code) in a sandboxed subprocess, under hard limits.

`run_sandboxed(code, stdin)` runs `python -I -S -B main.py` with `stdin` on its standard input
and returns a SandboxResult; it never raises for anything the code does. What is in force:

- its own unprivileged uid and gid (one per concurrent run, leased from SANDBOX_UIDS by a lock
  file, never 0 and in no passwd), no supplementary groups, PR_SET_NO_NEW_PRIVS: root-only host
  files are unreadable, and RLIMIT_NPROC (counted per real uid, ignored for root) counts only
  this run's processes, so a fork bomb in one run cannot starve a concurrent one;
- rlimits: CPU seconds (SIGXCPU at `cpu_s`, SIGKILL one second later), address space, file
  size, open files, processes, no core files;
- fresh namespaces, made by a small root launcher (sandbox_launcher.py) before it drops privileges:
  network (only a loopback, left down: every connect fails with ENETUNREACH), pid (the code
  runs under a root init that is pid 1 of the namespace and exits with it, and then the kernel
  kills every process the code started, even ones that left the process group with setsid),
  mount (a private /proc; every mount
  read-only; an allow-list of system folders, VISIBLE_ROOTS, stays visible and every other
  top-level folder (/home, /root, /tmp, /var, a checkout under /work or anywhere else) is
  covered by an empty read-only tmpfs, as is /dev/shm, and every other top-level file by
  /dev/null, so world-readable files, datasets included, and host unix sockets are out of sight;
  the working folder is a size-limited tmpfs, so writes never reach the host disk), ipc (no
  System V or POSIX IPC objects shared with, or left on, the host) and cgroup;
- a scrubbed environment (PATH, LANG, HOME = the working folder, nothing of the parent's);
- a working folder made for the run (mode 0700, owned by the sandbox uid, the cwd): the caller
  stages the code in /tmp/sealrl-sbx-*, the launcher takes it and removes that folder, and the
  code runs in a tmpfs mounted at the same path inside its namespace, gone with it;
- a wall-clock deadline: SIGKILL to the whole process group (pid namespace included), reaped;
- no orphan: PR_SET_PDEATHSIG=SIGKILL on the launcher, on init and on the code (set after the
  uid change, which clears it, then a liveness check of the parent), so killing the caller
  kills the launcher, then init, then the whole namespace.

Not in force: a seccomp filter (the whole syscall surface of the kernel is reachable), a cgroup
memory or pids limit, hiding world-readable files in the visible system folders (/etc, /usr).

Where the platform refuses any of this (not root, unshare not permitted, no mount_setattr),
the run is REFUSED with a message naming what failed, unless `allow_weak=True`: then it runs
with whatever could be set up and `result.weakened` lists what is missing. A refusal is an
infrastructure fault, never a verdict on the code.

Expected outputs never enter the sandbox: callers pass inputs on stdin and compare stdout in
the parent (sealrl.rewards.code). Output kept per stream is capped at `max_output_bytes`.
Memory is bounded per process (RLIMIT_AS), so the total is at most max_processes * memory_mb.
Linux only; root is needed for the uid change and the namespaces.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterator, Sequence

SANDBOX_PYTHON = "/usr/bin/python3"
"""Interpreter for the launcher and the code: it must be executable by an unprivileged uid and
lie under VISIBLE_ROOTS (a venv in a checkout or under /root is neither)."""
SANDBOX_UIDS = range(1_900_000_000, 1_900_004_096)
"""uids (and equal gids) leased to runs, one per concurrent run; no file on the host is theirs."""
VISIBLE_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/dev",
                 "/proc")
"""The only top-level entries the sandboxed code sees (an allow-list: a folder the list does not
name is covered, so a checkout or dataset in an unusual place is hidden too)."""
_LOCK_DIR = "/run/sealrl-sandbox"  # root-only; one lock file per leased uid
_COVERED_INSIDE_VISIBLE = ("/dev/shm",)  # world-writable, shared with the host
_LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")  # its source, run with python -c
_REFUSED_EXIT = 125  # launcher exit code after it reported a refusal on the status pipe
_REAP_GRACE_S = 2.0  # after a SIGKILL, how long the pipes may take to close


class SandboxStatus(str, Enum):
    OK = "ok"              # exited 0
    ERROR = "error"        # exited non-zero (an exception, MemoryError, fork failure, ...)
    TIMEOUT = "timeout"    # still running at the wall-clock deadline: killed
    KILLED = "killed"      # ended by a signal (SIGXCPU at the CPU limit, SIGXFSZ, SIGSEGV, ...)
    REFUSED = "refused"    # not run, or not run as asked: an infrastructure failure


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxResult:
    status: SandboxStatus
    exit_code: int | None
    """Exit status; -N when ended by signal N; None when refused before it ran."""
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float | None = None
    """CPU seconds the program's process used (with the children it reaped); None if unknown."""
    limit: str | None = None
    """Which limit ended it: "wall", "cpu", "file_size", or, read from stderr (best effort),
    "memory", "processes", "open_files"; None when none is known."""
    message: str = ""
    """Why it was refused, or what the launcher reported."""
    weakened: tuple[str, ...] = ()
    """Isolation that could not be set up (non-empty only with allow_weak=True)."""


def run_sandboxed(code: str, stdin: str = "", *, cpu_s: int = 2, wall_s: float = 5.0,
                  memory_mb: int = 256, file_size_mb: int = 1, max_open_files: int = 32,
                  max_processes: int = 8, allow_weak: bool = False,
                  max_output_bytes: int = 64 * 1024, python: str = SANDBOX_PYTHON,
                  visible_roots: Sequence[str] = VISIBLE_ROOTS) -> SandboxResult:
    """Run `code` (Python source) with `stdin` as its input, isolated and limited (module doc)."""
    for field, value in (("cpu_s", cpu_s), ("wall_s", wall_s), ("memory_mb", memory_mb),
                         ("file_size_mb", file_size_mb), ("max_open_files", max_open_files),
                         ("max_processes", max_processes), ("max_output_bytes", max_output_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"run_sandboxed: {field} must be a positive number, got {value!r}")
    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("run_sandboxed: code and stdin must be str")
    weakened: list[str] = []
    problem = _check_python(python, visible_roots)
    if problem:
        return _refused(problem)
    if os.geteuid() != 0:
        weakened.append("uid: not root, cannot run the code as a separate unprivileged uid "
                        "(no RLIMIT_NPROC, no namespaces)")
        if not allow_weak:
            return _refused("; ".join(weakened))
    with _leased_uid(os.geteuid() == 0) as uid:
        workdir = tempfile.mkdtemp(prefix="sealrl-sbx-")
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if uid is not None:
                os.chown(os.path.join(workdir, "main.py"), uid, uid)
                os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
            config = {"parent_pid": os.getpid(), "python": python, "workdir": workdir,
                      "uid": uid, "allow_weak": allow_weak, "weakened": weakened,
                      **_masks(visible_roots),
                      "tmpfs_mb": 4 * math.ceil(file_size_mb), "cpu_s": math.ceil(cpu_s),
                      "memory_bytes": math.ceil(memory_mb * 2**20),
                      "file_bytes": math.ceil(file_size_mb * 2**20),
                      "max_open_files": math.ceil(max_open_files),
                      "max_processes": math.ceil(max_processes)}
            return _run(config, stdin, float(wall_s), int(max_output_bytes))
        finally:
            if uid is not None:
                _kill_uid(uid)  # belt and braces: the pid namespace already took them all
            shutil.rmtree(workdir, ignore_errors=True)


def _masks(visible_roots: Sequence[str]) -> dict[str, list[str]]:
    """What to cover: {"masks": folders (tmpfs), "file_masks": files (/dev/null bound over)}.

    Every top-level entry outside `visible_roots` (symlinks are skipped: what they point to is
    either visible or covered itself), plus the shared scratch folders inside visible ones."""
    visible = {os.path.normpath(p) for p in visible_roots}
    masks, file_masks = [], []
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if path in visible or os.path.islink(path):
            continue
        if os.path.isdir(path):
            masks.append(path)
        elif os.path.isfile(path):
            file_masks.append(path)
    masks += [p for p in _COVERED_INSIDE_VISIBLE if os.path.isdir(p) and not os.path.islink(p)]
    return {"masks": masks, "file_masks": file_masks}


def _refused(message: str, wall_s: float = 0.0) -> SandboxResult:
    return SandboxResult(status=SandboxStatus.REFUSED, exit_code=None, stdout="", stderr="",
                         wall_s=wall_s, message=message)


def _check_python(python: str, visible_roots: Sequence[str]) -> str:
    real = os.path.realpath(python)
    if not os.path.isfile(real):
        return f"sandbox interpreter {python!r} does not exist"
    if not any(real.startswith(os.path.normpath(p) + "/") for p in visible_roots):
        return (f"sandbox interpreter {real!r} lies outside the folders visible in the sandbox "
                f"({', '.join(visible_roots)})")
    path = real
    while True:  # every folder on the way must be searchable, the file executable, by anyone
        mode = os.stat(path).st_mode
        if not mode & stat.S_IXOTH:
            return f"sandbox interpreter {real!r}: {path!r} is not accessible to other users"
        if path == "/":
            return ""
        path = os.path.dirname(path)


@contextmanager
def _leased_uid(root: bool) -> Iterator[int | None]:
    """A uid from SANDBOX_UIDS that no other run holds, for the duration of the block."""
    if not root:
        yield None
        return
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in SANDBOX_UIDS:  # lowest free first: as many lock files as concurrent runs
        path = os.path.join(_LOCK_DIR, str(uid))
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)  # releases the lock
        return
    raise RuntimeError(f"run_sandboxed: all {len(SANDBOX_UIDS)} sandbox uids are in use")


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid`: a forked helper takes the uid and calls kill(-1)."""
    for _ in range(3):  # a racing fork bomb can add a process during one sweep
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)  # every process this uid may signal, except itself
            except BaseException:
                pass
            os._exit(0)
        os.waitpid(pid, 0)


def _run(config: dict, stdin: str, wall_s: float, max_output_bytes: int) -> SandboxResult:
    status_r, status_w = os.pipe()
    start = time.monotonic()
    with tempfile.TemporaryFile() as stdin_file:  # a file, not a pipe: no writer to deadlock
        stdin_file.write(stdin.encode())
        stdin_file.flush()
        # The code gets a read-only descriptor of the (unlinked) file: no writes to host disk.
        stdin_fd = os.open(f"/proc/self/fd/{stdin_file.fileno()}", os.O_RDONLY | os.O_CLOEXEC)
        config["status_fd"] = status_w
        try:
            proc = subprocess.Popen(
                [config["python"], "-I", "-S", "-B", "-c", _LAUNCHER.read_text(), json.dumps(config)],
                stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_w,), start_new_session=True, cwd="/",
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        except OSError as e:
            os.close(status_r)
            return _refused(f"could not start the sandbox launcher: {e}")
        finally:
            os.close(status_w)
            os.close(stdin_fd)
    try:
        streams = _drain(proc, {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr",
                                status_r: "status"}, start + wall_s, max_output_bytes)
    except BaseException:  # e.g. KeyboardInterrupt: never leave the run behind
        _killpg(proc.pid)
        raise
    finally:
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
    timed_out = streams.pop("timed_out")
    elapsed = time.monotonic() - start
    return _verdict(streams, timed_out, proc.returncode, elapsed, max_output_bytes,
                    config["cpu_s"])


def _drain(proc: subprocess.Popen, fds: dict[int, str], deadline: float,
           max_output_bytes: int) -> dict:
    """Read every pipe to EOF, keeping at most max_output_bytes (+1, to see truncation) each;
    SIGKILL the process group at the deadline, then allow _REAP_GRACE_S for the pipes to close."""
    out: dict = {name: bytearray() for name in fds.values()}
    out["timed_out"] = False
    with selectors.DefaultSelector() as sel:
        for fd in fds:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                if out["timed_out"]:
                    break  # something outside our reach keeps a pipe open; stop waiting
                out["timed_out"] = True
                _killpg(proc.pid)
                deadline = time.monotonic() + _REAP_GRACE_S
                continue
            for key, _ in sel.select(left):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = out[fds[key.fd]]
                if len(buf) <= max_output_bytes:  # keep draining past the cap, keep nothing
                    buf += chunk[: max_output_bytes + 1 - len(buf)]
    if proc.poll() is None:  # pipes closed but the launcher lingers (should not happen)
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out["timed_out"] = True
            _killpg(proc.pid)
    return out


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}
_STDERR_LIMITS = (("MemoryError", "memory"), ("[Errno 11] Resource temporarily unavailable",
                  "processes"), ("[Errno 24] Too many open files", "open_files"),
                  ("[Errno 27] File too large", "file_size"))


def _verdict(streams: dict, timed_out: bool, launcher_code: int, elapsed: float,
             max_output_bytes: int, cpu_limit: int) -> SandboxResult:
    reports = [json.loads(line) for line in bytes(streams["status"]).decode().splitlines()
               if line.startswith("{")]
    report = {k: v for r in reports for k, v in r.items()}
    weakened = tuple(report.get("weakened", ()))

    def text(name: str) -> tuple[str, bool]:
        raw = bytes(streams[name])
        return raw[:max_output_bytes].decode("utf-8", "replace"), len(raw) > max_output_bytes

    stdout, stdout_cut = text("stdout")
    stderr, stderr_cut = text("stderr")
    if "refused" in report:
        return _refused(report["refused"], elapsed)
    code, cpu = report.get("exit_code"), report.get("cpu_s")
    if timed_out:
        status, limit = SandboxStatus.TIMEOUT, "wall"
    elif code is None:  # the launcher died without reporting (killed from outside)
        return _refused(f"the sandbox launcher ended without a report (exit {launcher_code}); "
                        f"stderr: {stderr[-300:]!r}", elapsed)
    elif code < 0:
        status, limit = SandboxStatus.KILLED, _SIGNAL_LIMITS.get(-code)
        if code == -signal.SIGKILL and cpu is not None and cpu >= cpu_limit:
            limit = "cpu"  # the hard limit: it ignored (or handled) SIGXCPU
    else:
        status = SandboxStatus.OK if code == 0 else SandboxStatus.ERROR
        limit = next((name for needle, name in _STDERR_LIMITS if needle in stderr), None) \
            if code else None
    return SandboxResult(status=status, exit_code=code, stdout=stdout, stderr=stderr,
                         stdout_truncated=stdout_cut, stderr_truncated=stderr_cut,
                         wall_s=elapsed, cpu_s=cpu, limit=limit, weakened=weakened)
