"""The sandbox launcher: run by sealrl.rewards.sandbox as `python -I -S -B -c <this file's
source> <config json>`, never imported.

The launcher runs as root in a fresh `python -I -S -B`, so no state of the caller (threads,
signal handlers, imported modules) is involved: it makes the namespaces and mounts and forks
`init` (pid 1 of the new pid namespace), which forks the code's process: that one sets its
limits, drops privileges and execs the code. init reports the code's exit status and CPU time
on the status pipe. Each process dies with its parent (PDEATHSIG).
"""
if __name__ != "__main__":
    raise ImportError("sealrl.rewards.sandbox_launcher is run by sandbox.py with python -c, never imported")

import ctypes  # noqa: E401 - one compact script
import errno
import json
import os
import resource
import select
import signal
import sys

cfg = json.loads(sys.argv[1])
status_fd = cfg["status_fd"]
os.set_inheritable(status_fd, False)
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_char_p]
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWIPC = 0x20000, 0x2000000, 0x8000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYS_mount_setattr, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # x86_64 and aarch64 alike
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2

def report(**kw):
    os.write(status_fd, (json.dumps(kw) + "\n").encode())

def refuse(msg):
    report(refused=msg)
    os._exit(125)

def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")

def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")

# Die with the caller; if it died before prctl took effect, stop now.
check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
if os.getppid() != cfg["parent_pid"]:
    os._exit(124)
weakened = list(cfg["weakened"])
have = {}
for name, flag in (("mount", CLONE_NEWNS), ("network", CLONE_NEWNET), ("pid", CLONE_NEWPID),
                   ("ipc", CLONE_NEWIPC), ("cgroup", CLONE_NEWCGROUP)):
    have[name] = libc.unshare(flag) == 0
    if not have[name]:
        weakened.append(f"{name} namespace: unshare failed: {os.strerror(ctypes.get_errno())}")
if weakened and not cfg["allow_weak"]:
    refuse("isolation not available here (pass allow_weak=True to run without it): "
           + "; ".join(weakened))
workdir, uid = cfg["workdir"], cfg["uid"]
# The caller's folder is only a staging area: take the code and remove it, so that nothing of
# the run stays on the host even if the caller is SIGKILLed (it removes whatever comes back).
with open(os.path.join(workdir, "main.py"), "rb") as f:
    code = f.read()
os.unlink(os.path.join(workdir, "main.py"))
os.rmdir(workdir)

def make_workdir(path, on_tmpfs):
    if on_tmpfs:  # size-limited: what the code writes never reaches the host disk
        os.makedirs(path)
        owner = f",uid={uid},gid={uid}" if uid is not None else ""
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={cfg['tmpfs_mb']}m,nr_inodes=256,mode=0700{owner}")
    else:
        os.mkdir(path, 0o700)
    with open(os.path.join(path, "main.py"), "wb") as f:
        f.write(code)
    if uid is not None:
        os.chown(path, uid, uid)
        os.chown(os.path.join(path, "main.py"), uid, uid)
    os.chdir(path)
    return path

try:
    if not have["mount"]:
        raise OSError(errno.EPERM, "no mount namespace")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted below reaches the host
    class MountAttr(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint64) for n in ("set", "clr", "propagation", "userns")]
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    check(libc.syscall(SYS_mount_setattr, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                       ctypes.sizeof(attr)), "mount_setattr(/, read-only, recursive)")
    for p in cfg["masks"]:
        mount("tmpfs", p, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
              "size=64k,nr_inodes=64,mode=0755")
    for p in cfg["file_masks"]:  # a bind mount of /dev/null reads as an empty file
        mount("/dev/null", p, None, MS_BIND)
    workdir = make_workdir(os.path.join("/tmp", os.path.basename(workdir)), True)
    for p in cfg["masks"]:
        mount(None, p, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
except OSError as e:
    if not cfg["allow_weak"]:
        refuse(f"sandbox set-up failed: {e}")
    if have["mount"]:
        weakened.append(f"mounts: {e}")
    try:
        workdir = make_workdir(workdir, False)  # on the host; the caller removes it
    except OSError as e:
        refuse(f"sandbox set-up failed (weak mode): {e}")
report(weakened=weakened)
def spawn(child):
    """Fork; the child runs child(lifeline) and must not return. The lifeline reads EOF once
    this process is gone, which the child checks after arming PDEATHSIG."""
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(lifeline_r)
        return pid
    try:
        os.close(lifeline_w)
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        if select.select([lifeline_r], [], [], 0)[0]:
            os._exit(124)
        child(lifeline_r)
    except BaseException as e:
        refuse(f"sandbox child set-up failed: {type(e).__name__}: {e}")
    os._exit(124)

def run_code(lifeline_r):
    limits = ((resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1),
              (resource.RLIMIT_AS, cfg["memory_bytes"], cfg["memory_bytes"]),
              (resource.RLIMIT_FSIZE, cfg["file_bytes"], cfg["file_bytes"]),
              (resource.RLIMIT_NOFILE, cfg["max_open_files"], cfg["max_open_files"]),
              (resource.RLIMIT_CORE, 0, 0))
    if uid is not None:  # NPROC counts every process of the real uid: only ours once dropped
        limits += ((resource.RLIMIT_NPROC, cfg["max_processes"], cfg["max_processes"]),)
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))
    os.umask(0o077)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(errno.EPERM, "uid change did not take")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # The uid change cleared PDEATHSIG: arm it again, then make sure the parent still lives.
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if select.select([lifeline_r], [], [], 0)[0]:
        os._exit(124)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "HOME": workdir, "TMPDIR": workdir}  # -I ignores PYTHON* variables anyway
    py = cfg["python"]
    os.execve(py, [py, "-I", "-S", "-B", "main.py"], env)

def init(lifeline_r):
    # pid 1 of the new pid namespace (root, no limits): its exit makes the kernel kill every
    # process left in the namespace. The code runs as its child, not as pid 1, because pid 1
    # ignores signals it has no handler for, SIGXCPU and SIGXFSZ included. Reaps orphans.
    if have["pid"] and have["mount"]:
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this namespace only
    code_pid = spawn(run_code)
    while True:
        pid, wait_status, usage = os.wait4(-1, 0)
        if pid == code_pid:
            report(exit_code=os.waitstatus_to_exitcode(wait_status),
                   cpu_s=usage.ru_utime + usage.ru_stime)
            os._exit(0)

os.waitpid(spawn(init), 0)
