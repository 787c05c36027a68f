"""The local sandbox backend: a fresh process per run, in a bubblewrap jail where bwrap works.

Each jail: ``--unshare-all`` (no network, own pid/ipc/uts/cgroup/user namespaces, no nested
user namespaces), read-only binds of /usr (and /lib*, /bin) and the Python prefix, a synthesized
/etc (passwd, group, ld.so.cache), a fresh /proc, a minimal /dev, private size-capped tmpfs work
dir and /tmp (program files are copied in from memfds: nothing touches the host disk), a new
session, uid/gid 65534 (as root, bwrap itself runs as 65534 so that RLIMIT_NPROC bites; the
count is per jail, since each jail has its own user namespace), and rlimits. Killing the jail's
init ends its pid namespace, so nothing outlives the jail. A cold jail's init is a tiny Python
program (:data:`COLD_INIT`) that runs the program as its child; it first replaces bwrap's tmpfs's
with inode-capped ones (bwrap cannot cap inodes: an empty file costs no page of a tmpfs's size,
but its inode is kernel memory) with capabilities in the jail's own user namespace, which it then
drops, from its bounding set too; it is non-dumpable and gives up its copies of the host's pipes
before the program starts, so that the program (same uid) can neither reopen them through
/proc/1/fd nor make the init write there through /proc/1/mem; bwrap reaps it, so no process of a
run is left on the host for its pid 1 to reap.

Warm jails (``warm_jails=True``, the default with bwrap; :mod:`.sandbox_warm`): each worker
keeps one such jail, set up the same way, whose supervisor is a small non-dumpable zygote
(:mod:`.jail_server`, the stdlib pre-imported; it keeps ``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN`` and
``CAP_SETPCAP`` in the jail's own user namespace, and no run does, not even in its bounding set).
Per run it forks a fresh process, always pid 2 (the zygote sets its pid namespace's counter
back), which takes new mount, IPC and network namespaces with fresh tmpfs's on /work, /tmp and
/dev/shm (so no inode number, pid, packet counter or IPC id tells it what an earlier run did;
their inodes are capped too), drops its capabilities, reads the request (from a memfd the zygote
never reads: no run's data is left in the memory later runs are forked from), writes the files,
applies the rlimits (RLIMIT_NPROC counts per user namespace, i.e. per jail, and nothing of an
earlier run is left to count) and runs the program. A seccomp filter (:mod:`.seccomp`) refuses
the kernel keyring (shared by every jail's uid), memory outside the address space (SysV shared
memory, memfds), which no rlimit caps, and setting another process's rlimits (the zygote's,
which later runs would inherit). When it exits, every other process in the jail is killed, and
the keyring and the zygote's rlimits and scheduling checked; the host replaces the whole jail on
anything unusual. ``warm_jails=False`` starts one jail (and interpreter) per run: slower. This
module builds the bwrap command lines for both and runs the cold path; :mod:`.sandbox_warm` runs
the warm one.

Where memory cgroups can be made here (:mod:`.memory_cgroup`), each cold run and each warm jail
is in its own, capped for the run as a whole (RLIMIT_AS caps each process only); the run's first
process enters it before it starts anything. Groups are made for the fallback below too.

Without bwrap (missing or not usable here), the fallback gives rlimits, a process group, a
temporary work dir and (as root) uid 65534 only: no network or filesystem isolation, and a
daemon that calls setsid() escapes the process group (killed with the run's memory cgroup where
there is one, else it outlives the run). It says so once, loudly.
"""

from __future__ import annotations

import logging
import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from ...core.errors import warn_caller
from .docker_image import base_python, readable_by_others, runtime_tree
from .jail_init import RUN_PROGRAM
from .jail_server import inode_cap
from .memory_cgroup import SHELL, MemoryGroup, MemoryGroups, find_memory_groups, run_cap_mb
from .seccomp import jail_filter
from .sandbox import (DEFAULT_HASH_SEED, PYTHON_NAMES, WORK_DIR, ExecResult, Program, Sandbox, SandboxError,
                      SandboxLimits, make_result, next_time_limit, python_command, python_environment)
from .sandbox_warm import (MB, ZYGOTE_SOURCE, WarmJails, close_fd, init_pidfd, kill_and_wait, kill_group, memfd,
                           pipe, read_ready, rlimits)

log = logging.getLogger(__name__)
NOBODY = 65534
JAIL_PATH = "/usr/local/bin:/usr/bin:/bin"
PASSWD = b"nobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n"
GROUP = b"nogroup:x:65534:\n"
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) "
                "and allow user namespaces (sysctl kernel.unprivileged_userns_clone=1)")
_warned_fallback = False

# A cold jail's pid 1 (``python -I -S -c COLD_INIT tmpfs_options argv...``), which runs ``argv`` and
# exits as it did (128 + the signal after a signal death, as a shell would). bwrap hands it the
# host's ends of the output pipes and it runs as the program's uid, so the program must not reach
# it: it makes itself non-dumpable (no /proc/1/mem to write code into, no /proc/1/fd to reopen the
# pipes, which on a non-root host belong to that uid) and lets go of the pipes before the program
# starts (the child waits for that), so that even where prctl failed it holds nothing of the
# host's. How it runs the program (signals, exec failures, reaping, exit status) is
# :data:`.jail_init.RUN_PROGRAM`, shared with the docker bootstrap; when it exits, the pid
# namespace ends and bwrap reaps it.
#
# bwrap cannot cap a tmpfs's inodes, and the jail cannot remount bwrap's tmpfs's (their
# superblocks belong to bwrap's outer user namespace; the jail's capabilities are in the one
# nested in it). So, given ``tmpfs_options`` (else "": bwrap's tmpfs's as they are), the init,
# holding COLD_CAPABILITIES, takes a mount namespace of its own, mounts fresh tmpfs's with those
# options on /tmp, /dev/shm and /work, moves the program's files into the new /work, and drops
# every capability, from its bounding set and ambient set too, checking that none is left (as a
# warm jail's runs do, see .jail_server.drop_capabilities), before the program is forked; on any
# failure the program does not run (exit 126). Where that fails at start-up (a setuid bwrap refuses
# --cap-add; a kernel may refuse the mounts), cold jails run uncapped, with a warning and a note
# in the isolation line. A probe that only timed out (a loaded host) is no such verdict: it is
# tried again at the next cold run, COLD_CAP_PROBES times in all.
COLD_INIT = RUN_PROGRAM + r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE, 0

def check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, "could not %s: %s" % (what, os.strerror(code)))

def move_files(source, target):
    for entry in list(os.scandir(source)):
        mode = entry.stat(follow_symlinks=False).st_mode
        if entry.is_dir(follow_symlinks=False):
            os.mkdir(entry.name, 0o700, dir_fd=target)
            inner_source = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=source)
            inner_target = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=target)
            move_files(inner_source, inner_target)
            os.fchmod(inner_target, mode & 0o7777)   # as bwrap made it, whatever the umask
            os.close(inner_source)
            os.close(inner_target)
            os.rmdir(entry.name, dir_fd=source)
            continue
        reader = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=source)
        writer = os.open(entry.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=target)
        os.fchmod(writer, mode & 0o7777)
        while os.sendfile(writer, reader, None, 1 << 20):
            pass
        os.close(reader)
        os.close(writer)
        os.unlink(entry.name, dir_fd=source)   # its pages are freed, not left under the new /work

def fresh_tmpfs(options):
    check(libc.unshare(0x20000), "unshare a mount namespace")   # CLONE_NEWNS
    check(libc.mount(None, b"/", None, 0x44000, None), "make the mounts private")   # MS_REC | MS_PRIVATE
    old_work = os.open("/work", os.O_RDONLY | os.O_DIRECTORY)
    for root in ("/tmp", "/dev/shm", "/work"):
        data = "%s,mode=%o" % (options, os.lstat(root).st_mode & 0o7777)
        nosuid_nodev = 0x2 | 0x4
        check(libc.mount(b"tmpfs", root.encode(), b"tmpfs", nosuid_nodev, data.encode()), "mount a tmpfs on " + root)
    new_work = os.open("/work", os.O_RDONLY | os.O_DIRECTORY)
    move_files(old_work, new_work)
    os.close(old_work)
    os.close(new_work)
    os.chdir("/work")

def drop_capabilities():
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if libc.prctl(23, cap, 0, 0, 0) == 1:   # PR_CAPBSET_READ
            check(libc.prctl(24, cap, 0, 0, 0), "drop capability %d from the bounding set" % cap)   # PR_CAPBSET_DROP
    check(libc.prctl(47, 4, 0, 0, 0), "clear the ambient capabilities")   # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    header, sets = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()   # version 3, this process
    check(libc.capset(header, sets), "drop the capabilities")
    with open("/proc/self/status") as f:
        held = [line.split(":")[0] for line in f if line.startswith("Cap") and int(line.split()[1], 16)]
    if held:
        raise OSError(1, "capabilities are left after dropping them all: " + ", ".join(held))

if sys.argv[1]:
    try:
        fresh_tmpfs(sys.argv[1])
        drop_capabilities()
    except OSError as exc:
        os.write(2, ("rftgym jail: could not set up the inode-capped tmpfs's, not running the program: %s\n"
                     % exc).encode())
        os._exit(126)
argv = sys.argv[2:]
released_r, released_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(released_w)
    os.read(released_r, 1)   # end of file once the init holds no copy of stdin, stdout or stderr
    os.close(released_r)
    exec_program(argv)
os.closerange(0, 3)
os.close(released_r)
os.close(released_w)
exit_as(child)
"""
# What a cold jail's init needs, in the jail's own user namespace, to mount its inode-capped
# tmpfs's (and to drop the capabilities again, from its bounding set too).
COLD_CAPABILITIES = ("CAP_SYS_ADMIN", "CAP_SETPCAP")
# How many probes, in all, may try the inode cap while each times out (at start-up, then one at each
# of the next cold runs): enough for a passing load, few enough that a host always too slow for
# the probe's time limit stops paying for one.
COLD_CAP_PROBES = 3
# What every probe runs: it works wherever the jail does.
PROBE = Program({"main.py": "import sys; print(sys.version_info[0])"},
                limits=SandboxLimits(wall_seconds=20, cpu_seconds=10))


class LocalSandbox(Sandbox):
    """Runs each program in a fresh local process; see the module docstring for the isolation."""

    name = "local"

    def __init__(self, *, limits: SandboxLimits | None = None, workers: int | None = None,
                 use_bwrap: bool | None = None, warm_jails: bool = True):
        super().__init__(limits=limits, workers=workers)
        if use_bwrap not in (None, True, False):
            raise SandboxError(f"use_bwrap must be True, False or None (auto), got {use_bwrap!r}")
        if warm_jails not in (True, False):
            raise SandboxError(f"warm_jails must be True or False, got {warm_jails!r}")
        self.jails: WarmJails | None = None   # with warm jails only
        self.as_root = os.geteuid() == 0
        self.prlimit = next((p for p in ("/usr/bin/prlimit", "/bin/prlimit") if os.access(p, os.X_OK)), None)
        # Dropping to 65534 through setpriv keeps Popen on its vfork path (Popen(user=...) forks,
        # which is slow from a big process such as one holding a model).
        self.setpriv = shutil.which("setpriv") if self.as_root else None
        # A memory cgroup per run (cold) or per jail (warm), where one can be made here; set up
        # first, so that the probes below run in one as every run does.
        self.memory_groups, self.memory_cap_note = self._try_memory_groups()
        self._memory_group_warned = False
        runtime = base_python()
        # As root we run as 65534, which must be able to read the interpreter.
        self.tree = "" if not self.as_root or readable_by_others(runtime.executable) else runtime_tree()
        self.python = runtime.executable
        self.bwrap_base: list[str] | None = None
        self.seccomp: bytes | None = None  # the jail's seccomp filter (see .seccomp)
        # Whether a cold jail's init caps its tmpfs's inodes (see COLD_INIT); probed only where cold jails run.
        self.cold_inode_cap = False
        self._cold_cap_probes_left = 0   # > 0 while the probe has only timed out: the next cold run tries again
        self._cold_cap_warned = False
        self._cold_cap_probing = threading.Lock()   # one retry at a time; other runs go on uncapped meanwhile
        problem = None
        if use_bwrap is not False:
            bwrap = shutil.which("bwrap")
            problem = "bwrap is not installed" if bwrap is None else self._try_bwrap(bwrap)
            if problem and use_bwrap:
                raise SandboxError(f"use_bwrap=True but bubblewrap is not usable here ({problem}); {INSTALL_HINT}, "
                                   "or pass use_bwrap=None to fall back to rlimits only")
        if self.bwrap_base and warm_jails:
            self._try_warm()
        if self.bwrap_base and not self.warm:
            self._cold_cap_probes_left = COLD_CAP_PROBES
            self._try_cold_inode_cap()
        if self.warm:
            self.isolation = ("bubblewrap jail per worker (no network, read-only system, private tmpfs /work and "
                              f"/tmp, own pid namespace, uid {NOBODY}, {self._filter_text}), fresh forked process per "
                              "run with rlimits in its own mount, IPC and network namespaces (fresh tmpfs's), jail "
                              f"cleaned between runs, {self.memory_cap_note}")
        elif self.bwrap_base:
            self.isolation = self._cold_isolation()
        else:
            self.isolated = False
            uid = f"uid {NOBODY}" if self.as_root else "the current user"
            self.isolation = (f"rlimits + process group + temp dir only, as {uid} (NO network or filesystem "
                              "isolation: bubblewrap " + ("disabled" if use_bwrap is False else "unavailable")
                              + f"), {self.memory_cap_note}")
            _warn_fallback(problem or "use_bwrap=False")

    # -- the memory cgroup ------------------------------------------------------------------
    def _try_memory_groups(self) -> tuple[MemoryGroups | None, str]:
        """Memory cgroups for runs if one can be made, capped and entered by a run's first process
        (run as the programs are) here; else None, and runs are capped per process only."""
        groups, found = find_memory_groups(NOBODY if self.as_root else None)
        if groups is None:
            log.info("rftgym local sandbox: no memory cap per run, only per process (%s)", found)
            return None, f"memory capped per process only ({found})"
        group = None
        try:
            group = groups.new()
            proc = self._popen_as_nobody([SHELL, "-c", "exit 0"], "the memory cgroup's probe", memory_group=group,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            _, err = proc.communicate(timeout=10)
        except (SandboxError, subprocess.TimeoutExpired, OSError) as exc:
            proc_problem = str(exc)
        else:
            proc_problem = None if proc.returncode == 0 else err.decode("utf-8", "replace").strip()[-200:]
        finally:
            if group is not None:
                group.remove()
        if proc_problem is not None:
            log.info("rftgym local sandbox: no memory cap per run: a run cannot enter its cgroup (%s)", proc_problem)
            return None, f"memory capped per process only (a run cannot enter its cgroup: {proc_problem})"
        return groups, "memory capped per run (a cgroup each)"

    def _memory_group(self, limits: SandboxLimits) -> MemoryGroup | None:
        """A fresh group capped for ``limits``; None without groups, or (with a warning, once) where
        one cannot be made now: the run goes on capped per process."""
        if self.memory_groups is None:
            return None
        try:
            group = self.memory_groups.new()
        except OSError as exc:
            self._warn_memory_group(exc)
            return None
        try:
            group.cap(run_cap_mb(limits.memory_mb, limits.disk_mb) * MB)
        except OSError as exc:
            group.remove()
            self._warn_memory_group(exc)
            return None
        return group

    def _warn_memory_group(self, exc: OSError) -> None:
        if not self._memory_group_warned:
            self._memory_group_warned = True
            log.warning("rftgym local sandbox: could not make a run's memory cgroup (%s); such runs are capped per "
                        "process only", exc)

    # -- bubblewrap -------------------------------------------------------------------------
    @property
    def _filter_text(self) -> str:
        return "no keyring, SysV or memfd memory (seccomp)" if self.seccomp else "NO seccomp filter"

    def _cold_isolation(self) -> str:
        uncapped = "" if self.cold_inode_cap else " (NO inode cap)"
        return (f"bubblewrap: no network, read-only system, private tmpfs /work and /tmp{uncapped}, own "
                f"pid namespace, uid {NOBODY}, {self._filter_text}, rlimits, {self.memory_cap_note}")

    def _try_bwrap(self, bwrap: str) -> str | None:
        """Set up the bwrap command line and check that a trivial program runs in it."""
        base = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                base += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                base += ["--ro-bind", top, top]
        if os.path.exists("/etc/ld.so.cache"):
            base += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        runtime = base_python()
        prefix = runtime.prefix
        if not prefix.startswith("/usr/"):
            base += ["--ro-bind", self.tree + prefix if self.tree else prefix, prefix]
            site = os.path.join(runtime.stdlib, "site-packages")
            if not self.tree and os.path.isdir(site) and site.startswith(prefix + "/"):
                base += ["--tmpfs", site, "--remount-ro", site]   # stdlib only: hide site-packages
        base += ["--proc", "/proc", "--dev", "/dev"]
        self.bwrap_base = base
        wanted_filter = jail_filter()
        for self.seccomp in dict.fromkeys([wanted_filter, None]):   # a jail without the filter rather than none
            ok, probe = self._probe()
            if ok:
                break
        if ok and wanted_filter is not None and self.seccomp is None:
            log.warning("rftgym local sandbox: bwrap refused the jail's seccomp filter; runs can reach the "
                        "kernel keyring and SysV/memfd memory")
        elif ok and wanted_filter is None:
            log.warning("rftgym local sandbox: no seccomp filter for this machine (%s); runs can reach the kernel "
                        "keyring and SysV/memfd memory", os.uname().machine)
        if ok:
            return None
        self.bwrap_base = None
        return (probe.stderr.strip() or f"exit {probe.exit_code}, signal {probe.signal}")[-500:]

    def _try_cold_inode_cap(self) -> None:
        """Let a cold jail's init cap its tmpfs's inodes if the jail, which works without the cap,
        still works with it; else cold jails run uncapped (a jail without the cap rather than
        none), with a warning (one) that says what failed. Probed apart, once a jail works, so that
        a failure here is the cap's, and a broken bwrap costs no probe for it. A refusal is final;
        a probe that timed out leaves ``_cold_cap_probes_left`` for the next cold runs to retry."""
        self._cold_cap_probes_left -= 1
        probe = self._probe_cold_inode_cap()
        if _probe_ran(probe):
            self._cold_cap_probes_left = 0
            self.cold_inode_cap = True
            self.isolation = self._cold_isolation()
            if self._cold_cap_warned:
                log.info("rftgym local sandbox: the inode cap's probe ran this time; cold jails now cap their "
                         "tmpfs's inodes")
            return
        final = not probe.timed_out or self._cold_cap_probes_left <= 0
        if final:
            self._cold_cap_probes_left = 0
        if not self._cold_cap_warned or not probe.timed_out:  # the first failure, or a refusal after timeouts
            self._cold_cap_warned = True
            self._warn_uncapped(probe)
        elif final:
            log.info("rftgym local sandbox: the inode cap's last probe failed too (%s); cold jails keep running "
                     "without the cap", _how_it_failed(probe))

    def _warn_uncapped(self, probe: ExecResult) -> None:
        held = " and ".join(COLD_CAPABILITIES)
        uncapped = ("their tmpfs's keep the kernel's default inode limit and a run can pin kernel memory with empty "
                    "files")
        if probe.timed_out:
            log.warning("rftgym local sandbox: the probe of a cold jail whose init holds %s to mount inode-capped "
                        "tmpfs's %s, likely on a host too loaded for its time limit; until a probe runs (one at each "
                        "of the next %d cold runs at most) cold jails run without the cap, so %s",
                        held, _how_it_failed(probe), self._cold_cap_probes_left, uncapped)
            return
        log.warning("rftgym local sandbox: a cold jail whose init holds %s to mount inode-capped tmpfs's does not "
                    "run here (%s); cold jails run without the cap, so %s. Likely causes: a setuid bwrap, which "
                    "refuses --cap-add (to fix: install one that is not setuid); or a kernel or security module "
                    "(AppArmor, SELinux) that forbids mounting a tmpfs in a user namespace",
                    held, _how_it_failed(probe), uncapped)

    def _retry_cold_inode_cap(self) -> None:
        """Probe the inode cap again, after a probe that timed out; runs on other threads meanwhile
        go on uncapped rather than wait for it."""
        if not self._cold_cap_probing.acquire(blocking=False):
            return
        try:
            if self._cold_cap_probes_left > 0:
                self._try_cold_inode_cap()
        finally:
            self._cold_cap_probing.release()

    def _probe(self) -> tuple[bool, ExecResult]:
        """Whether a trivial program runs in the jail as set up, and its result."""
        probe = self.run(PROBE)
        return _probe_ran(probe), probe

    def _probe_cold_inode_cap(self) -> ExecResult:
        """The probe's result in a cold jail whose init caps its tmpfs's inodes, whatever
        ``cold_inode_cap`` says (runs on other threads go by it meanwhile)."""
        return self._run_cold(PROBE, PROBE.limits, capped=True)

    def _bwrap_command(self, program: Program, limits: SandboxLimits, keep: list[int], capped: bool) -> list[str]:
        cmd = self._jail_mounts(self.bwrap_base, limits.disk_mb, keep)
        for d in sorted({os.path.dirname(p) for p in program.files} - {""}):
            cmd += ["--dir", f"{WORK_DIR}/{d}"]
        for path, text in program.files.items():
            cmd += ["--perms", "0644", "--file", str(memfd(text.encode(), keep)), f"{WORK_DIR}/{path}"]
        return [*cmd, *self._jail_settings("{info}", program.hash_seed), *self._cold_init(limits.disk_mb, capped),
                *self._limited(program, limits, nproc_extra=1)]

    def _cold_init(self, disk_mb: int, capped: bool) -> list[str]:
        """The start of a cold jail's command after its options: :data:`COLD_INIT` as the jail's
        pid 1. bwrap's own init (without --as-pid-1) reports the program's exit and exits before
        bwrap has reaped it, so each run would leave it to the host's pid 1 to reap: a zombie under
        a pid 1 that reaps late, or never (a container's own program). bwrap reaps this one itself.
        With ``capped``, the init gets the capabilities and options for tmpfs's of the
        same size as bwrap's, their inodes capped as a warm jail's are."""
        if not capped:
            return ["--as-pid-1", "--", self.python, "-I", "-S", "-c", COLD_INIT, ""]
        size = disk_mb * MB
        return ["--as-pid-1", *(a for cap in COLD_CAPABILITIES for a in ("--cap-add", cap)), "--",
                self.python, "-I", "-S", "-c", COLD_INIT, f"size={size},nr_inodes={inode_cap(size)}"]

    def _jail_mounts(self, base: list[str], disk_mb: int, keep: list[int]) -> list[str]:
        disk = str(disk_mb * MB)
        seccomp = ["--seccomp", str(memfd(self.seccomp, keep))] if self.seccomp else []
        return [*base, *seccomp, "--ro-bind-data", str(memfd(PASSWD, keep)), "/etc/passwd",
                "--ro-bind-data", str(memfd(GROUP, keep)), "/etc/group",
                "--size", disk, "--tmpfs", "/tmp", "--size", disk, "--tmpfs", "/dev/shm",
                "--size", disk, "--tmpfs", WORK_DIR]

    @staticmethod
    def _jail_settings(info_fd: str, hash_seed: int) -> list[str]:
        # bwrap's own root and /dev are unsized tmpfs: read-only, or a program could fill host memory.
        environment = {"PATH": JAIL_PATH, "HOME": WORK_DIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                       **python_environment(hash_seed)}
        return ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR, "--clearenv",
                *(a for name, value in environment.items() for a in ("--setenv", name, value)), "--info-fd", info_fd]

    # -- both modes -------------------------------------------------------------------------
    def _limited(self, program: Program, limits: SandboxLimits, nproc_extra: int = 0) -> list[str]:
        argv = list(program.argv)
        if argv[0] in PYTHON_NAMES:
            argv = python_command(self.python, argv[1:])   # the script dir stays importable (no -P)
        if self.prlimit is None:
            return argv
        return [self.prlimit, *(f"--{k}={s}:{h}" for k, (s, h) in rlimits(limits, nproc_extra).items()), "--", *argv]

    @property
    def warm(self) -> bool:
        return self.jails is not None

    def run(self, program: Program) -> ExecResult:
        limits = self.limits_for(program)
        if self.jails:
            return self.jails.run(program, limits)
        if self._cold_cap_probes_left > 0:
            self._retry_cold_inode_cap()
        return self._run_cold(program, limits, capped=self.cold_inode_cap)

    def _run_cold(self, program: Program, limits: SandboxLimits, capped: bool) -> ExecResult:
        keep: list[int] = []   # fds closed here whatever happens
        workdir = None
        group = self._memory_group(limits)
        oom_killed = False
        try:
            stdin = memfd(program.stdin.encode(), keep)
            if self.bwrap_base:
                info_r, info_w = pipe(keep)
                cmd = [a.replace("{info}", str(info_w)) for a in self._bwrap_command(program, limits, keep, capped)]
                cwd, env = None, {"PATH": JAIL_PATH}
            else:
                info_r = info_w = None
                workdir = self._write_workdir(program)
                cmd, cwd = self._limited(program, limits), workdir
                env = {"PATH": JAIL_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                       **python_environment(program.hash_seed)}
                if self.tree:
                    env["LD_LIBRARY_PATH"] = self.tree + (base_python().libdir or "")
                    cmd = [self.tree + a if a == self.python else a for a in cmd]
            preexec = None if self.prlimit else _preexec(limits, 1 if self.bwrap_base else 0)
            started = time.monotonic()
            proc = self._popen_as_nobody(
                cmd, "the sandboxed process", stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=cwd, env=env, pass_fds=[fd for fd in keep if fd not in (stdin, info_r)], preexec_fn=preexec,
                memory_group=group)
            if info_w is not None:
                keep.remove(info_w)
                os.close(info_w)
            init_pidfds: list[int] = []   # drive's pidfd of the namespace init, kept even if drive fails
            try:
                out, err, timed_out, truncated = drive(proc, limits, started, info_r, init_pidfds)
            finally:
                keep += init_pidfds
                returncode = _end_cold(proc, init_pidfds[0] if init_pidfds else None)
            wall = time.monotonic() - started
            oom_killed = group is not None and group.oom_kills() > 0
        finally:
            for fd in keep:
                close_fd(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
            if group is not None:
                group.remove()
        term = -returncode if returncode < 0 else None
        if self.bwrap_base and returncode > 128 and returncode - 128 in _SIGNALS:
            term = returncode - 128   # bwrap reports a signal death of the program as 128 + signal
        return make_result(returncode=returncode, term_signal=term, stdout=out, stderr=err,
                           timed_out=timed_out, truncated=truncated, wall=wall, oom_killed=oom_killed)

    def _popen_as_nobody(self, cmd: list[str], what: str, memory_group: MemoryGroup | None = None,
                         **popen) -> subprocess.Popen:
        """Popen in a new session, in ``memory_group`` if given; as root, as 65534 (so that
        RLIMIT_NPROC applies: root ignores it)."""
        if self.as_root and self.setpriv:
            cmd = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *cmd]
        elif self.as_root:
            popen.update(user=NOBODY, group=NOBODY, extra_groups=[])
        if memory_group is not None:
            cmd = memory_group.enter(cmd)
        try:
            return subprocess.Popen(cmd, start_new_session=True, **popen)
        except OSError as exc:
            raise SandboxError(f"could not start {what} ({exc}); check that {cmd[0]} exists "
                               "and is executable") from exc

    # -- warm jails (run by .sandbox_warm) ----------------------------------------------------
    def _try_warm(self) -> None:
        self.jails = WarmJails(self._spawn_jail, capacity=self.workers, python=self.python,
                               memory_group=self._memory_group)
        try:
            # The sandbox's own disk size, so that the probe's jail is the first one used.
            probe = self.jails.run(Program({"main.py": "import sys; print(sys.version_info[0])"}),
                                   SandboxLimits(wall_seconds=20, cpu_seconds=10, disk_mb=self.limits.disk_mb))
        except (SandboxError, OSError) as exc:
            problem = str(exc)
        else:
            if probe.stdout.strip() == "3" and probe.exit_code == 0:
                return
            problem = (probe.stderr.strip() or f"exit {probe.exit_code}, signal {probe.signal}")[-500:]
        self.jails.close()
        self.jails = None
        log.warning("rftgym local sandbox: warm jails do not work here (%s); using one jail per run", problem)

    def _spawn_jail(self, disk_mb: int, keep: list[int], zygote_fd: int, info_fd: int,
                    group: MemoryGroup | None) -> subprocess.Popen:
        """Start bwrap, in ``group`` if given, for a warm jail whose zygote talks on ``zygote_fd``
        (see WarmJails)."""
        # No --die-with-parent: its signal fires when the *thread* that started bwrap exits, and
        # jails outlive threads. The zygote exits (ending the namespace) when the host's end closes.
        base = [a for a in self.bwrap_base if a != "--die-with-parent"]
        # The zygote's hash seed is every forked run's; a run with another seed is exec'd afresh.
        # The zygote gives each run fresh namespaces and mounts (see .jail_server), with these
        # capabilities in the jail's own user namespace; no run keeps any.
        cmd = [*self._jail_mounts(base, disk_mb, keep), "--as-pid-1", "--cap-add", "CAP_SYS_ADMIN",
               "--cap-add", "CAP_NET_ADMIN", "--cap-add", "CAP_SETPCAP",
               *self._jail_settings(str(info_fd), DEFAULT_HASH_SEED), "--",
               *python_command(self.python, ["-c", ZYGOTE_SOURCE, str(zygote_fd)])]
        return self._popen_as_nobody(cmd, "a warm jail", memory_group=group, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={"PATH": JAIL_PATH},
                                     pass_fds=keep)

    def close(self) -> None:
        super().close()
        if self.jails is not None:
            self.jails.close()

    def _write_workdir(self, program: Program) -> str:
        workdir = tempfile.mkdtemp(prefix="rftgym-sandbox-")
        for path, text in program.files.items():
            target = os.path.join(workdir, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
        if self.as_root:
            for top, dirs, files in os.walk(workdir):
                for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                    os.chown(name, NOBODY, NOBODY)
        return workdir




_SIGNALS = {int(s) for s in signal.Signals}


def _probe_ran(probe: ExecResult) -> bool:
    return probe.stdout.strip() == "3" and probe.exit_code == 0


def _how_it_failed(probe: ExecResult, tail: int = 300) -> str:
    """How a probe failed, in one line: how it ended, then the end of its stderr."""
    if probe.timed_out:
        ended = f"timed out after {probe.wall_seconds:.0f} s"
    else:
        ended = f"exit {probe.exit_code}" if probe.exit_code is not None else f"signal {probe.signal}"
    stderr = " ".join(probe.stderr.split())
    if not stderr:
        return ended
    return f"{ended}: {'...' if len(stderr) > tail else ''}{stderr[-tail:]}"


_RESOURCE = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE,
             "nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE}


def _preexec(limits: SandboxLimits, nproc_extra: int):
    """Without prlimit: set the rlimits in the child before exec (slower: no vfork)."""
    values = rlimits(limits, nproc_extra)

    def apply():
        for name, pair in values.items():
            resource.setrlimit(_RESOURCE[name], pair)
    return apply


def drive(proc: subprocess.Popen, limits: SandboxLimits, started: float, info_fd: int | None,
          init_pidfds: list[int]):
    """Read stdout and stderr (each capped) and ``info_fd`` until EOF, the wall limit, or the
    output cap. Returns (stdout, stderr, timed_out, truncated), ``timed_out`` the time limit
    that stopped the run ("wall" or "quiet") or None; a pidfd of bwrap's namespace init,
    once known, goes into ``init_pidfds`` (the caller closes it, also when this raises). Never
    reaps ``proc``."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    info = bytearray()
    poller = select.poll()
    for fd in [*streams, *([info_fd] if info_fd is not None else [])]:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    open_fds = set(streams) | ({info_fd} if info_fd is not None else set())
    cap = limits.output_bytes
    truncated = False
    exited_at = timed_out = None
    last_output = started
    while open_fds & set(streams):
        now = time.monotonic()
        deadline, limit = next_time_limit(limits, started, last_output)
        if now >= deadline:
            timed_out = limit
            break
        if exited_at is not None and now - exited_at > 0.2:
            break   # the program is gone; something it left behind still holds the pipes
        for fd, chunk in read_ready(poller, open_fds, min(deadline - now, 0.05)):
            if not chunk:
                continue
            if fd == info_fd:
                info += chunk
                if not init_pidfds:
                    _append(init_pidfds, init_pidfd(bytes(info)))
            else:
                streams[fd] += chunk
                last_output = time.monotonic()
                truncated = truncated or len(streams[fd]) > cap
        if truncated:
            break
        if exited_at is None and _exited(proc.pid):
            exited_at = time.monotonic()
            kill_group(proc.pid)
    if info_fd in open_fds and not init_pidfds:
        try:
            _append(init_pidfds, init_pidfd(bytes(info) + os.read(info_fd, 1 << 12)))
        except OSError:
            pass
    out, err = (bytes(b[:cap]) for b in streams.values())
    return out, err, timed_out, truncated


def _append(items: list, item) -> None:
    if item is not None:
        items.append(item)


def _end_cold(proc: subprocess.Popen, init_pidfd: int | None) -> int:
    """Kill what is left of a cold run, reap bwrap (or the program) and close its pipes; the
    return code. Also the clean-up when reading the outputs failed."""
    try:
        if init_pidfd is not None:
            # Kill the namespace (its init) first, so that bwrap reaps the init and exits:
            # killing bwrap first would leave the init a zombie under the host's pid 1.
            kill_and_wait(init_pidfd)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if proc.returncode is None:   # not reaped yet, so its group id is still ours
            kill_group(proc.pid)
        return proc.wait()
    finally:
        proc.stdout.close()
        proc.stderr.close()


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it (so its group id stays ours to kill)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _warn_fallback(problem: str) -> None:
    global _warned_fallback
    if _warned_fallback:
        return
    _warned_fallback = True
    message = (f"rftgym local sandbox: bubblewrap is not in use ({problem}). Programs run with rlimits, a process "
               "group and a temp dir only: NO network isolation, NO filesystem isolation, daemons may survive. "
               f"To fix: {INSTALL_HINT}.")
    log.warning(message)
    warn_caller(message, RuntimeWarning)
