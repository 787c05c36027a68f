"""A memory cap on a whole local-sandbox run, through a memory cgroup, where one can be made here.

RLIMIT_AS caps each process of a run, not the run: a program allowed ``processes`` processes
could hold ``processes`` x ``memory_mb`` at once, and a few workers doing that exhaust the host.
Where this process may make child groups in its own memory cgroup with the memory controller
(cgroup v1's memory hierarchy, as root; on cgroup v2 only where this process's group may enable
memory for its children, which v2 refuses to a group that holds processes itself, as a
container's usually does: there the cap stays per process, and the sandbox's ``isolation`` says
so), each cold run and each warm jail gets its own group, and everything in it (the jail's supervisor,
the program and its children, and the files it writes on the jail's tmpfs's, which are memory too)
is capped at :func:`run_cap_mb`. Going over makes the kernel kill a process in the group (the
biggest: the program), and the run reports ``limit_hit == "memory"``.

Each group's ``cgroup.procs`` is written by the first process of the run itself, a ``/bin/sh``
that then execs the rest (:meth:`MemoryGroup.enter`), so nothing is forked before it is in the
group. Groups are named ``rftgym-<host pid>-<n>``; ones left by a host that died are removed when
the next sandbox starts here.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
MB = 1 << 20
# What a run's group holds besides the program: bwrap, the jail's init or zygote and the
# interpreter's own pages: about 15 MB measured for a warm jail; the rest is headroom.
OVERHEAD_MB = 64
SHELL = "/bin/sh"
# The run's first process moves itself into the group, then becomes the real command.
ENTER_SCRIPT = 'echo $$ > "$0" && exec "$@"'
GROUP_NAME = re.compile(r"rftgym-(\d+)-\d+")
_serial = itertools.count()
_serial_lock = threading.Lock()


def run_cap_mb(memory_mb: int, disk_mb: int) -> int:
    """The cap on a run's group: its ``memory_mb``, its three tmpfs's (/work, /tmp, /dev/shm, each
    ``disk_mb``: tmpfs pages are memory charged to the group) and :data:`OVERHEAD_MB`."""
    return memory_mb + 3 * disk_mb + OVERHEAD_MB


@dataclass(frozen=True)
class CgroupParent:
    """The directory child groups are made in, and the cgroup version (1 or 2) it belongs to."""

    path: str
    version: int


def locate(proc_cgroup: str, mountinfo: str) -> CgroupParent | None:
    """This process's memory cgroup directory, from the text of ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo``: cgroup v1's memory hierarchy if mounted, else the v2 one. None
    where it is not mounted, or mounted from a root that does not hold this process's group."""
    groups = {}   # version -> the group's path within its hierarchy
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        number, controllers, path = parts
        if "memory" in controllers.split(","):
            groups[1] = path
        elif number == "0" and controllers == "":
            groups[2] = path
    mounts = {}   # version -> (mount point, root of the mount within the hierarchy)
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        kind, _, options = line.split(" - ", 1)[1].partition(" ")
        super_options = options.split()[1].split(",") if len(options.split()) > 1 else []
        if kind == "cgroup" and "memory" in super_options:
            mounts.setdefault(1, (_unescape(fields[4]), fields[3]))
        elif kind == "cgroup2":
            mounts.setdefault(2, (_unescape(fields[4]), fields[3]))
    for version in (1, 2):
        if version not in groups or version not in mounts:
            continue
        mount_point, root = mounts[version]
        path = groups[version]
        if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
            return None
        relative = path[len(root):] if root != "/" else path
        return CgroupParent(os.path.join(mount_point, relative.lstrip("/")).rstrip("/"), version)
    return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


class MemoryGroups:
    """Makes :class:`MemoryGroup` s under ``parent``; :func:`find_memory_groups` finds one that works."""

    def __init__(self, parent: CgroupParent, owner_uid: int | None = None):
        self.parent = parent
        self.owner_uid = owner_uid   # who writes each group's cgroup.procs (the run's first process)

    def new(self) -> MemoryGroup:
        with _serial_lock:
            name = f"rftgym-{os.getpid()}-{next(_serial)}"
        return MemoryGroup(os.path.join(self.parent.path, name), self.parent.version, self.owner_uid)

    def remove_stale(self) -> None:
        """Remove groups left by hosts that are gone (a killed training run, say)."""
        try:
            names = os.listdir(self.parent.path)
        except OSError:
            return
        for name in names:
            match = GROUP_NAME.fullmatch(name)
            if match and not _pid_alive(int(match.group(1))):
                try:
                    os.rmdir(os.path.join(self.parent.path, name))
                except OSError:
                    pass   # still busy, or already gone


class MemoryGroup:
    """One run's (or warm jail's) memory cgroup. Made on construction; :meth:`remove` when done."""

    def __init__(self, path: str, version: int, owner_uid: int | None):
        self.path, self.version = path, version
        os.mkdir(path)
        try:
            if version == 2 and "memory" not in self._read("cgroup.controllers").split():
                raise OSError(errno.ENOTSUP, "the memory controller is not enabled for child groups of "
                              + os.path.dirname(path))
            if owner_uid is not None:
                os.chown(os.path.join(path, "cgroup.procs"), owner_uid, -1)
        except BaseException:
            self.remove()
            raise
        self.cap_bytes: int | None = None

    def enter(self, command: list[str]) -> list[str]:
        """``command``, run so that its process is in this group before it starts anything."""
        return [SHELL, "-c", ENTER_SCRIPT, os.path.join(self.path, "cgroup.procs"), *command]

    def cap(self, cap_bytes: int) -> None:
        """Cap the group's memory (and memory + swap, where swap is accounted) at ``cap_bytes``."""
        if cap_bytes == self.cap_bytes:
            return
        if self.version == 2:
            self._write("memory.max", str(cap_bytes))
            if os.path.exists(os.path.join(self.path, "memory.swap.max")):
                self._write("memory.swap.max", "0")
        else:
            swap = os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes"))
            # v1 keeps limit <= memory+swap limit at every write: lift the latter first.
            if swap:
                self._write("memory.memsw.limit_in_bytes", "-1")
            self._write("memory.limit_in_bytes", str(cap_bytes))
            if swap:
                self._write("memory.memsw.limit_in_bytes", str(cap_bytes))
        self.cap_bytes = cap_bytes

    def oom_kills(self) -> int:
        """How many processes the kernel has killed in this group for going over its cap."""
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Kill what is left in the group (a daemon a run started where no pid namespace ends it:
        the fallback without bwrap), then remove it once its processes are gone (a killed process
        leaves it a moment later); one still busy after a second is left for
        :meth:`MemoryGroups.remove_stale`."""
        deadline = time.monotonic() + 1.0
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    log.debug("could not remove memory cgroup %s: %s", self.path, exc)
                    return
            self._kill_members()
            time.sleep(0.01)

    def _kill_members(self) -> None:
        """SIGKILL every process still in the group, each through a pidfd taken while it is
        checked to be in the group, so that a pid reused in between is never signalled."""
        try:
            pids = [int(line) for line in self._read("cgroup.procs").split()]
        except (OSError, ValueError):
            return
        name = "/" + os.path.basename(self.path)   # rftgym-<host pid>-<n>: no other group's
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue   # gone already
            try:
                with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
                    if any(line.rstrip().endswith(name) for line in f):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name), encoding="ascii") as f:
            return f.read()

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w", encoding="ascii") as f:
            f.write(value)


def find_memory_groups(owner_uid: int | None) -> tuple[MemoryGroups | None, str]:
    """Groups for this host's runs, and what was found: None with the reason where no memory
    cgroup can be made and capped here (not root, no delegated subtree, no /bin/sh)."""
    if not os.access(SHELL, os.X_OK):
        return None, f"{SHELL} is missing"
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            proc_cgroup = f.read()
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mountinfo = f.read()
    except OSError as exc:
        return None, f"cannot read this process's cgroup ({exc})"
    parent = locate(proc_cgroup, mountinfo)
    if parent is None:
        return None, "no memory cgroup hierarchy is mounted where this process's group is"
    groups = MemoryGroups(parent, owner_uid)
    try:
        probe = groups.new()
    except OSError as exc:
        return None, f"cannot make a memory cgroup in {parent.path} ({exc.strerror or exc})"
    try:
        probe.cap(64 * MB)
        probe.oom_kills()
    except (OSError, ValueError) as exc:
        return None, f"cannot cap a memory cgroup in {parent.path} ({exc})"
    finally:
        probe.remove()
    groups.remove_stale()
    return groups, f"memory cgroup per run under {parent.path}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
