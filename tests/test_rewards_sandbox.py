"""The code sandbox against hostile programs, and CodeExecutionReward on top of it.

Every hostile run must end in bounded time with a failure status and leave the host as it was:
the autouse `host_unchanged` fixture checks after each test that no process of a sandbox uid
and no launcher is left, and that no sandbox folder or escape file remains in /tmp.

The isolation tests need root and namespaces (they hold on this project's Linux hosts); where
those are missing the sandbox refuses, which `test_refused_without_namespaces` checks anywhere
root can drop CAP_SYS_ADMIN.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sealrl.rewards.base import RewardSample
from sealrl.rewards.code import CodeExecutionReward, extract_code
from sealrl.rewards.sandbox import SANDBOX_UIDS, SandboxStatus, run_sandboxed

REPO = Path(__file__).resolve().parents[1]
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="the sandbox needs root (uid change, namespaces)")


def _sandbox_processes() -> list[str]:
    """Processes of a sandbox uid, and sandbox launchers (their argv names a sealrl-sbx folder)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
        if uid in SANDBOX_UIDS or b"sealrl-sbx-" in cmdline:
            found.append(f"{entry}: uid {uid} {cmdline[:80]!r}")
    return found


def _tmp_traces() -> set[str]:
    return set(glob.glob("/tmp/sealrl-sbx-*") + glob.glob("/tmp/sealrl_escape_*"))


@pytest.fixture(autouse=True)
def host_unchanged():
    before = _tmp_traces()
    assert not _sandbox_processes(), "sandbox processes exist before the test"
    yield
    end = time.monotonic() + 60.0   # generous: the wait ends as soon as they are gone
    while _sandbox_processes() and time.monotonic() < end:
        time.sleep(0.05)
    assert not _sandbox_processes()
    assert _tmp_traces() <= before


def _sample(response: str, tests: list[dict]) -> RewardSample:
    return RewardSample(sample_id="r/0/0/0", prompt="", response=response,
                        ground_truth={"tests": tests})


# -- limits in force before anything hostile runs -----------------------------------------------

PROBE = r"""
import json, os, resource
R = resource
status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
print(json.dumps({
    "uid": [os.getuid(), os.geteuid(), os.getgid()], "groups": os.getgroups(), "pid": os.getpid(),
    "limits": {n: R.getrlimit(getattr(R, "RLIMIT_" + n))
               for n in ("NPROC", "CPU", "AS", "FSIZE", "NOFILE", "CORE")},
    "no_new_privs": status["NoNewPrivs"].strip(), "cap_eff": status["CapEff"].strip(),
    "procs": [p for p in os.listdir("/proc") if p.isdigit()], "cwd": os.getcwd(),
    "cwd_mode": oct(os.stat(".").st_mode & 0o777), "cwd_owner": os.stat(".").st_uid,
    "env": dict(os.environ), "stdin_writable": os.access("/proc/self/fd/0", os.W_OK),
    "ns": {n: os.readlink(f"/proc/self/ns/{n}") for n in ("net", "pid", "mnt", "ipc", "cgroup")},
    "run": os.listdir("/run"), "fds": os.listdir("/proc/self/fd"),
}))
"""


# Wall limit of the runs of harmless programs (not what those tests check): generous, so a
# loaded machine never turns a normal run into a timeout. Their default is 5 s.
WALL_S = 60


def _probe(**limits) -> dict:
    result = run_sandboxed(PROBE, wall_s=WALL_S, **limits)
    assert result.status is SandboxStatus.OK, result
    return json.loads(result.stdout)


@needs_root
def test_probe_shows_limits_uid_and_namespaces_in_force():
    p = _probe(cpu_s=2, memory_mb=256, file_size_mb=1, max_open_files=32, max_processes=8)
    uid = p["uid"][0]
    assert uid in SANDBOX_UIDS and p["uid"] == [uid, uid, uid] and p["groups"] == []
    assert p["limits"] == {"NPROC": [8, 8], "CPU": [2, 3], "AS": [256 << 20] * 2,
                           "FSIZE": [1 << 20] * 2, "NOFILE": [32, 32], "CORE": [0, 0]}
    assert p["no_new_privs"] == "1" and int(p["cap_eff"], 16) == 0
    assert p["pid"] == 2 and sorted(p["procs"]) == ["1", "2"]  # own pid namespace and /proc
    assert p["cwd"].startswith("/tmp/sealrl-sbx-") and p["cwd_mode"] == "0o700"
    assert p["cwd_owner"] == uid
    assert set(p["env"]) == {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR"}
    assert p["env"]["HOME"] == p["cwd"]
    assert all(link != os.readlink(f"/proc/self/ns/{n}") for n, link in p["ns"].items())
    assert p["run"] == [] and p["stdin_writable"] is False
    assert sorted(p["fds"]) == ["0", "1", "2", "3"]  # 3: listdir's own; no launcher pipe leaks


# -- hostile programs ---------------------------------------------------------------------------

@needs_root
def test_fork_bomb_is_contained_by_nproc():
    # Never start the bomb unless the harmless probe shows the process limit and uid in force.
    p = _probe(max_processes=8)
    assert p["limits"]["NPROC"] == [8, 8] and p["uid"][0] != 0 and p["pid"] == 2
    start = time.monotonic()
    result = run_sandboxed("import os\nwhile True: os.fork()\n", max_processes=8, wall_s=5)
    assert time.monotonic() - start < 60   # bounded: a bomb that escaped would never end
    assert result.status in (SandboxStatus.ERROR, SandboxStatus.KILLED, SandboxStatus.TIMEOUT)
    if result.status is SandboxStatus.ERROR:
        assert result.limit == "processes", result.stderr[-300:]


@needs_root
def test_escaped_descendant_dies_with_the_run():
    code = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()          # leaves the process group: only the pid namespace catches it
            time.sleep(3600)
        print("parent done")
    """)
    start = time.monotonic()
    result = run_sandboxed(code, wall_s=WALL_S)
    # OK, not TIMEOUT: the run ended with the parent, not at the wall limit the child would reach
    assert result.status is SandboxStatus.OK and result.stdout == "parent done\n"
    assert time.monotonic() - start < WALL_S  # not the child's 3600 s


@needs_root
def test_infinite_loop_hits_the_cpu_limit():
    # A generous wall limit: on a loaded host 1 s of CPU can take several seconds of wall time.
    result = run_sandboxed("while True: pass\n", cpu_s=1, wall_s=WALL_S)
    assert result.status is SandboxStatus.KILLED and result.limit == "cpu"
    assert result.exit_code == -signal.SIGXCPU
    assert result.cpu_s > 0.5  # rusage lags the tick-based limit check a little
    handled = "import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\nwhile True: pass\n"
    result = run_sandboxed(handled, cpu_s=1, wall_s=WALL_S)  # ignores SIGXCPU: SIGKILL at 1 s more
    assert result.status is SandboxStatus.KILLED and result.limit == "cpu"
    assert result.exit_code == -signal.SIGKILL and result.cpu_s > 1.5


@needs_root
def test_sleep_hits_the_wall_deadline():
    # The deadline under test (3 s): a sandboxed interpreter prints "up" within a fraction of a
    # second, even on a loaded machine; the sleep (3600 s) never ends by itself.
    result = run_sandboxed("import time\nprint('up', flush=True)\ntime.sleep(3600)\n", wall_s=3)
    assert result.status is SandboxStatus.TIMEOUT and result.limit == "wall"
    assert result.stdout == "up\n" and result.wall_s < 60


@needs_root
def test_ten_gigabyte_allocation_hits_the_memory_limit():
    result = run_sandboxed("x = bytearray(10 * 1024**3)\n", memory_mb=256)
    assert result.status is SandboxStatus.ERROR and result.limit == "memory"
    assert "MemoryError" in result.stderr


@needs_root
def test_big_file_hits_the_file_size_limit():
    # Python ignores SIGXFSZ, so the write fails with EFBIG instead of the process being killed.
    result = run_sandboxed("open('big', 'wb').write(b'x' * (2 << 20))\n", file_size_mb=1)
    assert result.status is SandboxStatus.ERROR and result.limit == "file_size"
    assert "File too large" in result.stderr


@needs_root
def test_writes_outside_the_work_folder_fail_and_leave_nothing():
    name = f"sealrl_escape_{secrets.token_hex(6)}"
    targets = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", f"/etc/{name}",
               f"{REPO}/{name}", f"/{name}"]
    code = textwrap.dedent(f"""
        for path in {targets!r}:
            try:
                open(path, "w").write("x")
                print("WROTE", path)
            except OSError as e:
                print("denied", path, e.errno)
        open("inside.txt", "w").write("fine")  # the work folder itself is writable
        print("inside ok")
    """)
    result = run_sandboxed(code, wall_s=WALL_S)
    assert result.status is SandboxStatus.OK, result.stderr
    assert "WROTE" not in result.stdout and "inside ok" in result.stdout
    for path in targets:
        assert not os.path.exists(path), path


@needs_root
def test_host_files_are_unreadable():
    """World-readable files anywhere outside the visible system folders are out of sight: in
    /tmp, in the checkout (wherever it lies), in a top-level folder or file no list names."""
    secret = secrets.token_hex(16)
    tag = secrets.token_hex(6)
    readable = Path(f"/tmp/sealrl_escape_{tag}")
    top_dir, top_file = Path(f"/sealrl_escape_dir_{tag}"), Path(f"/sealrl_escape_{tag}.txt")
    top_dir.mkdir(mode=0o755)
    for path in (readable, top_dir / "data.txt", top_file):
        path.write_text(secret)
        path.chmod(0o644)
    try:
        paths = ["/etc/shadow", "/root/.bashrc", str(readable), str(REPO / "sealrl/__init__.py"),
                 str(top_dir / "data.txt"), str(top_file)]
        code = textwrap.dedent(f"""
            for path in {paths!r}:
                try:
                    text = open(path).read()[:40]
                    print("READ" if text else "empty", path, text)
                except OSError as e:
                    print("denied", path, e.errno)
        """)
        result = run_sandboxed(code, wall_s=WALL_S)
    finally:
        for path in (readable, top_dir / "data.txt", top_file):
            path.unlink()
        top_dir.rmdir()
    assert result.status is SandboxStatus.OK, result.stderr
    assert "READ" not in result.stdout and secret not in result.stdout, result.stdout
    assert result.stdout.count("denied") == 5 and f"empty {top_file}" in result.stdout


@needs_root
def test_network_is_unreachable():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        # 192.0.2.1 is TEST-NET-1 (RFC 5737): never routed, and no route exists in the sandbox.
        code = textwrap.dedent(f"""
            import socket, time
            for addr in [("127.0.0.1", {port}), ("192.0.2.1", 80)]:
                s = socket.socket()
                s.settimeout(20)
                start = time.monotonic()
                try:
                    s.connect(addr)
                    print("CONNECTED", addr)
                except OSError as e:
                    print("refused", addr, e.errno, round(time.monotonic() - start, 2))
        """)
        result = run_sandboxed(code, wall_s=WALL_S)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the host's loopback
    assert result.status is SandboxStatus.OK, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("refused") for line in lines)
    # refused at once (no route), not after the 20 s connect timeout
    assert all(int(line.split()[-2]) == errno.ENETUNREACH and float(line.split()[-1]) < 10
               for line in lines)


@needs_root
def test_killing_the_caller_kills_the_sandboxed_program():
    driver = textwrap.dedent("""
        import sys
        from sealrl.rewards.sandbox import run_sandboxed
        run_sandboxed("import time\\ntime.sleep(600)\\n", wall_s=600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO)
    try:
        end = time.monotonic() + 60   # generous: the wait ends once the sleeper is up
        while not any("main.py" in p for p in _sandbox_processes()):
            assert time.monotonic() < end, "the sandboxed sleeper never started"
            assert parent.poll() is None, "the caller exited early"
            time.sleep(0.05)
    finally:
        parent.kill()  # SIGKILL: no finally, no cleanup of its own
        parent.wait()
    end = time.monotonic() + 60   # generous; the sleeper alone would live 600 s
    while _sandbox_processes():
        assert time.monotonic() < end, f"left behind: {_sandbox_processes()}"
        time.sleep(0.05)
    # host_unchanged: its work folder is gone too (the launcher removed the staging folder).


@needs_root
def test_output_is_capped():
    result = run_sandboxed("import sys\nsys.stdout.write('y' * 1_000_000)\n", max_output_bytes=1000, wall_s=WALL_S)
    assert result.status is SandboxStatus.OK and result.stdout_truncated
    assert result.stdout == "y" * 1000


# -- refusal where isolation is not possible -----------------------------------------------------

REFUSAL_DRIVER = textwrap.dedent("""
    import json
    from sealrl.rewards.base import RewardSample
    from sealrl.rewards.code import CodeExecutionReward
    from sealrl.rewards.pool import RewardPool
    from sealrl.rewards.sandbox import run_sandboxed
    strict = run_sandboxed("print(1)", wall_s=60)
    weak = run_sandboxed("import os\\nprint(os.getuid())", allow_weak=True, wall_s=60)
    sample = RewardSample(sample_id="r/0/0/0", prompt="", response="print(1)",
                          ground_truth={"tests": [{"stdin": "", "stdout": "1"}]})
    pool = RewardPool(CodeExecutionReward(timeout_s=60), num_scorers=1, timeout_s=120)
    record = pool.score([sample])[0]
    pool.close()
    print(json.dumps({"strict": [strict.status, strict.message], "weak": [weak.status,
                      weak.stdout, list(weak.weakened)], "pool": [record.status, record.message]}))
""")


@needs_root
def test_refused_without_namespaces():
    # Same host, minus CAP_SYS_ADMIN (dropped from the bounding set): unshare fails with EPERM.
    out = subprocess.run(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin",
                          sys.executable, "-c", REFUSAL_DRIVER], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["strict"][0] == "refused" and "namespace: unshare failed" in got["strict"][1]
    status, stdout, weakened = got["weak"]
    assert status == "ok" and int(stdout) in SANDBOX_UIDS  # uid change still works
    assert sorted(w.split(" namespace:")[0] for w in weakened) == ["cgroup", "ipc", "mount",
                                                                   "network", "pid"]
    assert got["pool"][0] == "error" and "sandbox refused" in got["pool"][1]  # never a 0


# -- CodeExecutionReward ------------------------------------------------------------------------

ADD_TESTS = [{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 7\n", "stdout": "12"},
             {"stdin": "-1 1\n", "stdout": "0\n"}]
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_extract_code_takes_the_last_fence():
    text = "First:\n```python\nprint(0)\n```\nbetter:\n```py\nprint(1)\n```\n<eos>"
    assert extract_code(text) == "print(1)\n"
    assert extract_code("print(2)<eos>") == "print(2)"


@needs_root
def test_correct_program_passes_every_test():
    response = f"Here you go:\n```python\n{ADD}```"
    assert CodeExecutionReward(timeout_s=WALL_S)(_sample(response, ADD_TESTS)) == 1.0


@needs_root
def test_wrong_partial_and_failing_programs():
    # 5 s per test run: a sandboxed "print" takes a fraction of a second; the loop below never
    # ends and, with 10 s of CPU allowed, meets its 2 s wall limit first (a timeout)
    reward = CodeExecutionReward(timeout_s=5, cpu_s=10)
    assert reward(_sample("print(3)", ADD_TESTS)) == pytest.approx(1 / 3)
    assert CodeExecutionReward(all_or_nothing=True, timeout_s=WALL_S)(_sample("print(3)", ADD_TESTS)) == 0.0
    assert reward(_sample("print('nope')", ADD_TESTS)) == 0.0
    assert reward(_sample("raise SystemExit(3)", ADD_TESTS)) == 0.0  # a crash: failed, not error
    looping = CodeExecutionReward(timeout_s=2, cpu_s=10)
    assert looping(_sample("while True: pass", ADD_TESTS[:1])) == 0.0  # a timeout: failed too


@needs_root
def test_expected_output_is_not_visible_in_the_sandbox():
    secret = secrets.token_hex(16)
    snoop = textwrap.dedent("""
        import os, sys
        seen = [sys.stdin.read()] + [f"{k}={v}" for k, v in os.environ.items()] + sys.argv
        for top in (".", "/tmp", "/proc/1"):
            for root, dirs, files in os.walk(top):
                for f in files:
                    try:
                        seen.append(open(os.path.join(root, f), errors="replace").read(100000))
                    except OSError:
                        pass
                if root.startswith("/proc"):
                    dirs.clear()
        import re
        noise = open("/proc/self/cgroup").read()  # holds the host's 32-hex cgroup id
        found = [m for s in seen for m in re.findall(r"[0-9a-f]{32}", s) if m not in noise]
        print(found[0] if found else "nothing")
    """)
    reward = CodeExecutionReward(timeout_s=WALL_S)
    assert reward(_sample(snoop, [{"stdin": "x\n", "stdout": secret}])) == 0.0
    assert run_sandboxed(snoop, "x\n", wall_s=WALL_S).stdout == "nothing\n"


def test_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="ground_truth"):
        CodeExecutionReward()(_sample(ADD, []))
    with pytest.raises(ValueError, match="ground_truth"):
        CodeExecutionReward()(RewardSample(sample_id="r/0/0/0", prompt="", response=ADD,
                                           ground_truth={"tests": [{"stdin": "1 2"}]}))


@needs_root
def test_through_the_reward_pool():
    from sealrl.rewards.pool import RewardPool
    assert _probe(max_processes=8)["limits"]["NPROC"] == [8, 8]  # before the fork bomb below
    samples = [RewardSample(sample_id=f"r/0/{i}/0", prompt="", response=r,
                            ground_truth=json.dumps({"tests": ADD_TESTS}))
               for i, r in enumerate([ADD, "print(3)", "import os\nwhile True: os.fork()\n"])]
    # generous limits (not what this tests): 3 programs x 3 test runs, each far below its 20 s
    pool = RewardPool(CodeExecutionReward(timeout_s=20), num_scorers=1, timeout_s=300)
    try:
        records = pool.score(samples)
    finally:
        pool.close()
    assert [r.status for r in records] == ["ok", "ok", "ok"], [r.message for r in records]
    assert [r.total for r in records] == [1.0, pytest.approx(1 / 3), 0.0]
