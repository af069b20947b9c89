"""Caps on a sandbox as a whole: a child cgroup that its PID 1 joins before the code starts.

Loaded by _jail.py (standard library only; it runs with -I -S).
"""

import errno
import os
import time


class Cgroup:
    """A child cgroup per sandbox that caps its total memory and process count.

    cgroup v2 where this process's own cgroup lets it make a child with the memory and pids
    controllers; else cgroup v1's memory and pids hierarchies; else none (``kind`` says which).
    Everything is held by directory fds: after the pivot the host's /sys is out of sight.
    """

    def __init__(self, name, memory_bytes, pids):
        self.kind, self.dirs = "rlimits", []  # dirs: (parent_fd, name, fd)
        mounts = {}  # fstype or v1 controller -> mount point
        with open("/proc/self/mountinfo") as f:
            for row in f:
                left, right = row.split(" - ")
                fstype, _, opts = right.split()
                point = left.split()[4]
                if fstype == "cgroup2":
                    mounts.setdefault("cgroup2", point)
                elif fstype == "cgroup":
                    for ctl in ("memory", "pids"):
                        if ctl in opts.split(","):
                            mounts.setdefault(ctl, point)
        own = {}
        with open("/proc/self/cgroup") as f:
            for row in f:
                _, ctls, path = row.rstrip("\n").split(":", 2)
                for ctl in ctls.split(",") if ctls else ["cgroup2"]:
                    own[ctl] = path
        v2 = mounts.get("cgroup2"), own.get("cgroup2")
        try:
            if None not in v2 and self._v2(v2[0] + v2[1].rstrip("/"), name, memory_bytes, pids):
                return
        except OSError:
            self.remove()
        try:
            if all(mounts.get(c) and own.get(c) for c in ("memory", "pids")):
                self._make(
                    mounts["memory"] + own["memory"].rstrip("/"),
                    name,
                    {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes},
                )
                self._make(mounts["pids"] + own["pids"].rstrip("/"), name, {"pids.max": pids})
                self.kind = "cgroup v1"
        except OSError:  # not ours to write (a non-root user, a read-only cgroupfs)
            self.remove()

    def _v2(self, parent, name, memory_bytes, pids):
        with open(parent + "/cgroup.subtree_control") as f:
            if not {"memory", "pids"} <= set(f.read().split()):
                return False  # enabling them would need an empty cgroup: not ours to rearrange
        self._make(parent, name, {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": pids})
        self.kind = "cgroup v2"
        return True

    def _make(self, parent, name, settings):
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except BaseException:
            os.close(parent_fd)
            raise
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent_fd)
        self.dirs.append((parent_fd, name, fd))
        for key, value in settings.items():
            try:
                self._write(fd, key, str(value))
            except FileNotFoundError:  # memsw / swap.max: absent without swap accounting
                if "sw" not in key:
                    raise

    @staticmethod
    def _write(fd, key, text):
        w = os.open(key, os.O_WRONLY, dir_fd=fd)
        try:
            os.write(w, text.encode())
        finally:
            os.close(w)

    def join(self, pid):
        for _, _, fd in self.dirs:
            self._write(fd, "cgroup.procs", str(pid))

    def oom_killed(self):
        for _, _, fd in self.dirs:
            for key in ("memory.events", "memory.oom_control"):
                try:
                    r = os.open(key, os.O_RDONLY, dir_fd=fd)
                except FileNotFoundError:
                    continue
                try:
                    text = os.read(r, 4096).decode()
                finally:
                    os.close(r)
                for line in text.splitlines():
                    k, _, v = line.partition(" ")
                    if k == "oom_kill" and int(v) > 0:
                        return True
        return False

    def remove(self):
        """Once its processes are gone (PID 1's exit waits for them all), the cgroup can go."""
        for parent_fd, name, fd in self.dirs:
            os.close(fd)
            for _ in range(50):
                try:
                    os.rmdir(name, dir_fd=parent_fd)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        break
                    time.sleep(0.01)
            os.close(parent_fd)
        self.dirs = []
