"""Launcher that runs one command isolated; started by SubprocessSandbox as a trusted script.

Usage: python -I -S _jail.py HEX(marshal(config)). Standard library only (it runs with -I -S), and
few imports: this start-up is on the path of every run.

As root: new mount, network, PID, IPC and UTS namespaces; every mount read-only; /tmp an empty
read-only tmpfs but for the scratch dir, bound read-write at /tmp/scratch; the repo and $HOME
covered. The command runs under a small PID 1 of its own, as a uid that owns nothing but the
scratch dir (uid_base + this launcher's pid, so concurrent sandboxes never share an RLIMIT_NPROC
count), with rlimits and no_new_privs. As another user: the same inside a new user namespace
(identity-mapped uid, so its capabilities end at exec).

Killing PID 1 (wall-clock timeout, or this launcher dying: parent-death signal) makes the
kernel kill every process left in the namespace. The outcome goes to the fd named in the
config as one marshal'ed dict: {"ok": true, "exit": code|null, "signal": n|null, "timeout": bool,
"wall_s": s} or {"ok": false, "error": "..."}.
"""
import ctypes
import errno
import marshal
import os
import resource
import select
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in 5.12)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SIGKILL = 9
INSIDE = "/tmp/scratch"  # where the code sees its scratch dir

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class JailError(Exception):
    pass


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise JailError(f"{what} failed: {os.strerror(err)} (errno {err})")


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def make_all_readonly():
    """Every mount of this (private) namespace read-only, in one recursive call."""
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/",
                       ctypes.c_uint(AT_RECURSIVE), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if ret == 0:
        return
    if ctypes.get_errno() != errno.ENOSYS:
        _check(ret, "mount_setattr(/, AT_RECURSIVE, MOUNT_ATTR_RDONLY)")
    # Kernels before 5.12: remount each mount point, keeping its per-mount flags.
    keep = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in sorted(rows, key=lambda r: len(r[4])):
        point = row[4].encode().decode("unicode_escape")
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in row[5].split(","):
            flags |= keep.get(opt, 0)
        try:
            mount(None, point, None, flags)
        except JailError:
            if os.path.exists(point):
                raise


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def main():
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)

    def report(obj):
        os.write(status_fd, marshal.dumps(obj))
        os.close(status_fd)  # EOF for the caller, which need not wait for this process's exit

    try:
        pid1, status_r = setup_and_fork(cfg)
    except JailError as e:
        report({"ok": False, "error": str(e)})
        return
    report(supervise(pid1, status_r, cfg["wall_s"]))


def setup_and_fork(cfg):
    scratch = cfg["scratch"]
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if root:
        uid = gid = cfg["uid_base"] + os.getpid()
        # The sandbox uid owns the scratch dir and nothing else; lchown: never follow a link it planted.
        for d, dirs, files in os.walk(scratch):
            for name in [d] + [os.path.join(d, n) for n in dirs + files]:
                os.lchown(name, uid, gid)
        os.chmod(scratch, 0o700)
    else:
        uid, gid = os.getuid(), os.getgid()
        flags |= CLONE_NEWUSER
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        how = ("run as root (CAP_SYS_ADMIN), or allow unprivileged user namespaces "
               "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also kernel.apparmor_restrict_unprivileged_userns=0)")
        raise JailError(f"unshare(user/mount/net/pid namespaces) failed: {os.strerror(err)}; "
                        f"the subprocess sandbox cannot isolate here: {how}")
    if not root:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    scratch_fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY)  # before /tmp is covered: it may live there
    make_all_readonly()
    for path in cfg.get("hide", []):  # e.g. the repo (it holds the hidden tests' generator) and $HOME
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    # A private, read-only /tmp whose only entry is the scratch dir: the code sees one fixed path
    # and nothing of the host's /tmp (other episodes included).
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=16k,mode=0755")
    os.mkdir(INSIDE)
    mount(f"/proc/self/fd/{scratch_fd}", INSIDE, None, MS_BIND)
    mount(None, INSIDE, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)  # a bind starts read-only like its source
    mount(None, "/tmp", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.close(scratch_fd)
    try:
        libc.sethostname(b"sandbox", 7)
    except Exception:
        pass
    r, w = os.pipe2(os.O_CLOEXEC)  # the exec closes w: EOF on r before any message means it started
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(status_r)
        try:
            libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # this launcher killed: the namespace goes too
            child(cfg, uid, gid, root, status_w, w)
        except BaseException as e:  # noqa: BLE001 - report anything before exec, then die
            os.write(w, f"{type(e).__name__}: {e}".encode())
        os._exit(127)
    os.close(w)
    os.close(status_w)
    msg = b""
    while chunk := os.read(r, 4096):
        msg += chunk
    os.close(r)
    if msg:
        os.waitpid(pid, 0)
        raise JailError("sandbox child setup failed: " + msg.decode(errors="replace"))
    return pid, status_r


def child(cfg, uid, gid, root, status_w, exec_w):
    """PID 1 of the new PID namespace: mount its /proc, start the command, pass on how it ended.

    The command must not be PID 1 itself: PID 1 ignores signals it has no handler for, so
    SIGXCPU from RLIMIT_CPU (or the code's own kill()) would be lost.
    """
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            command(cfg, uid, gid, root)
        except BaseException as e:  # noqa: BLE001 - report anything before exec, then die
            os.write(exec_w, f"{type(e).__name__}: {e}".encode())
        os._exit(127)
    os.close(exec_w)  # now only the command holds it, until its exec
    _, status = os.waitpid(pid, 0)
    os.write(status_w, str(status).encode())
    os._exit(0)  # PID 1 exits: the kernel kills whatever the command left behind


def command(cfg, uid, gid, root):
    os.chdir(INSIDE)
    lim = cfg["limits"]
    mb = 1024 * 1024
    for res, soft, hard in [
        (resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1),  # soft: SIGXCPU, hard: SIGKILL
        (resource.RLIMIT_AS, lim["memory_mb"] * mb, lim["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, lim["fsize_mb"] * mb, lim["fsize_mb"] * mb),
        (resource.RLIMIT_NPROC, lim["nproc"], lim["nproc"]),
        (resource.RLIMIT_NOFILE, lim["nofile"], lim["nofile"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]:
        resource.setrlimit(res, (soft, hard))
    if root:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # drops every capability
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def supervise(pid, status_r, wall_s):
    t0 = time.monotonic()
    timed_out = False
    fd = os.pidfd_open(pid)
    if not select.select([fd], [], [], wall_s)[0]:
        timed_out = True
        os.kill(pid, SIGKILL)  # PID 1 dies: the kernel kills the rest of its namespace
    os.close(fd)
    os.waitpid(pid, 0)
    raw = b"" if timed_out else os.read(status_r, 64)
    os.close(status_r)
    if not raw:  # PID 1 was killed: the command with it
        timed_out = True
    status = int(raw) if raw else 0
    return {
        "ok": True,
        "exit": os.WEXITSTATUS(status) if raw and os.WIFEXITED(status) else None,
        "signal": (os.WTERMSIG(status) if os.WIFSIGNALED(status) else None) if raw else SIGKILL,
        "timeout": timed_out,
        "wall_s": round(time.monotonic() - t0, 4),
    }


if __name__ == "__main__":
    main()
