"""Launcher that runs one command isolated; started by SubprocessSandbox as a trusted script.

Usage: python -I -S _jail.py HEX(marshal(config)). Standard library only (it runs with -I -S), and
few imports: this start-up is on the path of every run.

The command sees a root of its own, not the host's: an empty read-only tmpfs holding read-only
binds of the system directories (/usr, /bin, /lib…), the interpreter's own installation (and
nothing else of $HOME or the repo when it lives there), /dev/null and friends, a fresh /proc, and
its scratch dir at /tmp/scratch: a size-limited tmpfs seeded with the run's files. So no Unix
socket of the host is reachable (/run, /var/run, /tmp, $HOME are simply absent; abstract sockets
belong to the network namespace, which is new and empty), and nothing the code writes outlives the
run. New mount, network, PID, IPC and UTS namespaces. As root the command runs as a uid that owns
nothing (uid_base + this launcher's pid) with no supplementary groups; as another user, inside a
new user namespace (identity-mapped, so its capabilities end at exec; its groups cannot be dropped
there, which the private root makes harmless for sockets).

Caps. Per process: rlimits (CPU, address space, file size, open files, processes). Per sandbox:
a child cgroup (v2, or v1's memory and pids hierarchies) capping the total memory and processes,
where this launcher may create one; otherwise the per-process limits are all there is (reported
as caps "rlimits"). The scratch tmpfs caps what the code can write.

Killing PID 1 (wall-clock timeout, or this launcher dying: parent-death signal) makes the
kernel kill every process left in the namespace. The outcome goes to the fd named in the
config as one marshal'ed dict: {"ok": true, "exit": code|null, "signal": n|null, "timeout": bool,
"wall_s": s, "oom": bool, "caps": str} or {"ok": false, "error": "..."}.
"""

import ctypes
import errno
import marshal
import os
import resource
import select
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's own dir out
from _cgroup import Cgroup  # noqa: E402 - after the path it needs

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in 5.12)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SIGKILL = 9
INSIDE = "/tmp/scratch"  # where the code sees its scratch dir
NEWROOT = "/tmp"  # where the new root is built (host /tmp is not needed inside: the interpreter never lives there)
OLDROOT = "/.oldroot"  # the host's root until PID 1 has mounted its /proc, then detached
DEVICES = ("null", "zero", "full", "random", "urandom")

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
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def make_all_readonly():
    """Every mount of this (private) namespace read-only, in one recursive call."""
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        b"/",
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
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


def bind(source, root):
    """Show ``source`` (a host path) read-only at the same path under ``root``; a symlink is copied."""
    target = root + source
    if os.path.islink(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.symlink(os.readlink(source), target)
    elif os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
        mount(source, target, None, MS_BIND | MS_REC)  # read-only like its source (make_all_readonly)
    elif os.path.exists(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
        mount(source, target, None, MS_BIND)


def build_root(cfg, scratch_fd, uid, gid, root_user):
    """The command's whole file system, built at NEWROOT; returns once it is read-only but for the scratch."""
    mount("tmpfs", NEWROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in cfg["binds"]:  # the system dirs and the interpreter's installation (sandbox.py)
        bind(path, NEWROOT)
    for name in DEVICES:
        bind("/dev/" + name, NEWROOT)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{NEWROOT}/dev/{name}")
    for d in ("/proc", OLDROOT, INSIDE):
        os.makedirs(NEWROOT + d, exist_ok=True)
    # The scratch: a fresh tmpfs of the allowed size, seeded with the run's files (regular files
    # at the top of the host's scratch dir; lchown-free: nothing is followed).
    scratch = NEWROOT + INSIDE
    mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={int(cfg['limits']['scratch_mb'])}m,mode=0700")
    for entry in os.scandir(scratch_fd):
        if not entry.is_file(follow_symlinks=False):
            continue
        src = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=scratch_fd)
        dst = os.open(f"{scratch}/{entry.name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            while chunk := os.read(src, 1 << 20):
                os.write(dst, chunk)
        finally:
            os.close(src)
            os.close(dst)
        if root_user:
            os.chown(f"{scratch}/{entry.name}", uid, gid)
    if root_user:
        os.chown(scratch, uid, gid)
    mount(None, NEWROOT, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    arch = os.uname().machine
    if arch not in SYS_PIVOT_ROOT:
        raise JailError(f"pivot_root: syscall number unknown for {arch}")
    _check(libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT[arch]), NEWROOT.encode(), (NEWROOT + OLDROOT).encode()), "pivot_root")
    os.chdir("/")


def main():
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)

    def report(obj):
        os.write(status_fd, marshal.dumps(obj))
        os.close(status_fd)  # EOF for the caller, which need not wait for this process's exit

    lim = cfg["limits"]
    # Before the namespaces: the host's cgroup file system is still in sight.
    cgroup = Cgroup(f"rollart-sandbox-{os.getpid()}", lim["total_memory_mb"] * 1024 * 1024, lim["nproc"] + 1)
    try:
        try:
            pid1, status_r = setup_and_fork(cfg, cgroup)
        except (JailError, OSError) as e:
            report({"ok": False, "error": f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)})
            return
        outcome = supervise(pid1, status_r, cfg["wall_s"])
        outcome.update(oom=cgroup.oom_killed(), caps=cgroup.kind)
    finally:
        cgroup.remove()
    report(outcome)


def setup_and_fork(cfg, cgroup):
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if root:
        uid = gid = cfg["uid_base"] + os.getpid()  # owns nothing on the host
    else:
        uid, gid = os.getuid(), os.getgid()
        flags |= CLONE_NEWUSER
    scratch_fd = os.open(cfg["scratch"], os.O_RDONLY | os.O_DIRECTORY)  # before /tmp is covered: it may live there
    if libc.unshare(ctypes.c_int(flags)) != 0:
        err = ctypes.get_errno()
        how = (
            "run as root (CAP_SYS_ADMIN), or allow unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu also kernel.apparmor_restrict_unprivileged_userns=0)"
        )
        raise JailError(
            f"unshare(user/mount/net/pid namespaces) failed: {os.strerror(err)}; the subprocess sandbox cannot isolate here: {how}"
        )
    if not root:
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"{uid} {uid} 1")
        write_file("/proc/self/gid_map", f"{gid} {gid} 1")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    make_all_readonly()
    try:
        build_root(cfg, scratch_fd, uid, gid, root)
    finally:
        os.close(scratch_fd)
    try:
        libc.sethostname(b"sandbox", 7)
    except Exception:
        pass
    r, w = os.pipe2(os.O_CLOEXEC)  # the exec closes w: EOF on r before any message means it started
    status_r, status_w = os.pipe2(os.O_CLOEXEC)
    go_r, go_w = os.pipe2(os.O_CLOEXEC)  # PID 1 starts nothing before it is in the sandbox's cgroup
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(status_r)
        os.close(go_w)
        try:
            libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # this launcher killed: the namespace goes too
            if os.read(go_r, 1) != b"1":
                raise JailError("the launcher did not let the sandbox start")
            child(cfg, uid, gid, root, status_w, w)
        except BaseException as e:  # noqa: BLE001 - report anything before exec, then die
            os.write(w, f"{type(e).__name__}: {e}".encode())
        os._exit(127)
    os.close(w)
    os.close(status_w)
    os.close(go_r)
    try:
        cgroup.join(pid)
        os.write(go_w, b"1")
    except OSError as e:
        os.kill(pid, SIGKILL)
        os.waitpid(pid, 0)
        raise JailError(f"could not put the sandbox into its cgroup: {e}") from None
    finally:
        os.close(go_w)
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
    # Only now: a user namespace may mount a new /proc only while a whole one is in sight.
    _check(libc.umount2(OLDROOT.encode(), MNT_DETACH), f"umount {OLDROOT}")
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
