"""The local sandbox backend: a fresh process per run, jailed by bubblewrap where it works.

With ``bwrap``: ``--unshare-all`` (no network, own pid/ipc/uts/cgroup/user namespaces, no nested
user namespaces), read-only binds of /usr (and /lib*, /bin) and the Python prefix, a synthesized
/etc (passwd, group, ld.so.cache), a fresh /proc, a minimal /dev, private size-capped tmpfs work
dir and /tmp (program files are copied in from memfds: nothing touches the host disk), a new
session, uid/gid 65534 (as root, bwrap itself runs as 65534 so that RLIMIT_NPROC bites; the
count is per run, since each run has its own user namespace), and rlimits set by ``prlimit``
inside the jail. Killing bwrap kills its pid namespace, so nothing outlives a run.

Warm jails (``warm_jails=True``, the default with bwrap): each worker keeps one such jail, set up
the same way, whose pid 1 is a small non-dumpable supervisor (:mod:`.jail_server`, the stdlib
pre-imported). Per run it writes the files into the empty /work and forks a fresh process that
applies the rlimits (RLIMIT_NPROC counts per user namespace, i.e. per jail, and nothing of an
earlier run is left to count) and runs the program (``python script`` in the forked interpreter,
anything else exec'd). When it exits, every other process in the jail is killed and /work, /tmp
and /dev/shm are wiped and checked. The host keeps the wall-clock limit and the output caps, and
replaces the whole jail when the supervisor dies or does not report in time, when a run hits the
wall, output, memory or disk limit, when the clean-up finds anything off, and every
``RECYCLE_AFTER`` runs. ``warm_jails=False`` starts one jail (and interpreter) per run: slower.

Without bwrap (missing or not usable here), the fallback gives rlimits, a process group, a
temporary work dir and (as root) uid 65534 only: no network or filesystem isolation, and a
daemon that calls setsid() can escape. It says so once, loudly.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import resource
import select
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .docker_image import base_python, readable_by_others, runtime_tree
from .sandbox import (PYTHON_NAMES, WORK_DIR, ExecResult, Program, Sandbox, SandboxError, SandboxLimits,
                      make_result)

log = logging.getLogger(__name__)
NOBODY = 65534
MB = 1 << 20
JAIL_PATH = "/usr/local/bin:/usr/bin:/bin"
PASSWD = b"nobody:x:65534:65534:nobody:/work:/usr/sbin/nologin\n"
GROUP = b"nogroup:x:65534:\n"
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap) "
                "and allow user namespaces (sysctl kernel.unprivileged_userns_clone=1)")
RECYCLE_AFTER = 200   # runs per warm jail before it is replaced anyway
START_SECONDS = 30.0  # for a warm jail to start and report ready
DRAIN_SECONDS = 0.5   # for the output pipes to close once the zygote has reported a clean jail
ZYGOTE_SOURCE = (Path(__file__).parent / "jail_server.py").read_text(encoding="utf-8")
_warned_fallback = False


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
        self.warm = False
        self._idle: list[WarmJail] = []
        self._jail_lock = threading.Lock()
        self.as_root = os.geteuid() == 0
        self.prlimit = next((p for p in ("/usr/bin/prlimit", "/bin/prlimit") if os.access(p, os.X_OK)), None)
        # Dropping to 65534 through setpriv keeps Popen on its vfork path (Popen(user=...) forks,
        # which is slow from a big process such as one holding a model).
        self.setpriv = shutil.which("setpriv") if self.as_root else None
        runtime = base_python()
        # As root we run as 65534, which must be able to read the interpreter.
        self.tree = "" if not self.as_root or readable_by_others(runtime.executable) else runtime_tree()
        self.python = runtime.executable
        self.bwrap_base: list[str] | None = None
        problem = None
        if use_bwrap is not False:
            bwrap = shutil.which("bwrap")
            problem = "bwrap is not installed" if bwrap is None else self._try_bwrap(bwrap)
            if problem and use_bwrap:
                raise SandboxError(f"use_bwrap=True but bubblewrap is not usable here ({problem}); {INSTALL_HINT}, "
                                   "or pass use_bwrap=None to fall back to rlimits only")
        if self.bwrap_base and warm_jails:
            self.warm = self._try_warm()
        if self.warm:
            self.isolation = ("bubblewrap jail per worker (no network, read-only system, private tmpfs /work and "
                              f"/tmp, own pid namespace, uid {NOBODY}), fresh forked process per run with rlimits, "
                              "jail cleaned between runs")
        elif self.bwrap_base:
            self.isolation = ("bubblewrap: no network, read-only system, private tmpfs /work and /tmp, own pid "
                              f"namespace, uid {NOBODY}, rlimits")
        else:
            uid = f"uid {NOBODY}" if self.as_root else "the current user"
            self.isolation = (f"rlimits + process group + temp dir only, as {uid} (NO network or filesystem "
                              "isolation: bubblewrap " + ("disabled" if use_bwrap is False else "unavailable") + ")")
            _warn_fallback(problem or "use_bwrap=False")

    # -- bubblewrap -------------------------------------------------------------------------
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
        probe = self.run(Program({"main.py": "import sys; print(sys.version_info[0])"},
                                 limits=SandboxLimits(wall_seconds=20, cpu_seconds=10)))
        if probe.stdout.strip() == "3" and probe.exit_code == 0:
            return None
        self.bwrap_base = None
        return (probe.stderr.strip() or f"exit {probe.exit_code}, signal {probe.signal}")[-500:]

    def _bwrap_command(self, program: Program, limits: SandboxLimits, keep: list[int]) -> list[str]:
        cmd = self._jail_mounts(self.bwrap_base, limits.disk_mb, keep)
        for d in sorted({os.path.dirname(p) for p in program.files} - {""}):
            cmd += ["--dir", f"{WORK_DIR}/{d}"]
        for path, text in program.files.items():
            cmd += ["--perms", "0644", "--file", _memfd(text.encode(), keep), f"{WORK_DIR}/{path}"]
        return cmd + self._jail_settings("{info}") + self._limited(program, limits, nproc_extra=1)

    def _jail_mounts(self, base: list[str], disk_mb: int, keep: list[int]) -> list[str]:
        disk = str(disk_mb * MB)
        return [*base, "--ro-bind-data", _memfd(PASSWD, keep), "/etc/passwd",
                "--ro-bind-data", _memfd(GROUP, keep), "/etc/group",
                "--size", disk, "--tmpfs", "/tmp", "--size", disk, "--tmpfs", "/dev/shm",
                "--size", disk, "--tmpfs", WORK_DIR]

    @staticmethod
    def _jail_settings(info_fd: str) -> list[str]:
        # bwrap's own root and /dev are unsized tmpfs: read-only, or a program could fill host memory.
        return ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORK_DIR, "--clearenv",
                "--setenv", "PATH", JAIL_PATH, "--setenv", "HOME", WORK_DIR, "--setenv", "TMPDIR", "/tmp",
                "--setenv", "LANG", "C.UTF-8", "--info-fd", info_fd]

    # -- both modes -------------------------------------------------------------------------
    def _limited(self, program: Program, limits: SandboxLimits, nproc_extra: int = 0) -> list[str]:
        argv = list(program.argv)
        if argv[0] in PYTHON_NAMES:
            argv = [self.python, "-E", "-s", *argv[1:]]   # -I minus -P: the script dir stays importable
        if self.prlimit is None:
            return ["--", *argv] if self.bwrap_base else argv
        return [self.prlimit, *(f"--{k}={s}:{h}" for k, (s, h) in rlimits(limits, nproc_extra).items()), "--", *argv]

    def run(self, program: Program) -> ExecResult:
        limits = self.limits_for(program)
        return self._run_warm(program, limits) if self.warm else self._run_cold(program, limits)

    def _run_cold(self, program: Program, limits: SandboxLimits) -> ExecResult:
        keep: list[int] = []
        workdir = None
        try:
            stdin = _memfd(program.stdin.encode(), keep, as_int=True)
            if self.bwrap_base:
                info_r, info_w = os.pipe()
                keep += [info_r, info_w]
                cmd = [a.replace("{info}", str(info_w)) for a in self._bwrap_command(program, limits, keep)]
                cwd, env = None, {"PATH": JAIL_PATH}
            else:
                info_r = info_w = None
                workdir = self._write_workdir(program)
                cmd, cwd = self._limited(program, limits), workdir
                env = {"PATH": JAIL_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
                if self.tree:
                    env["LD_LIBRARY_PATH"] = self.tree + (base_python().libdir or "")
                    cmd = [self.tree + a if a == self.python else a for a in cmd]
            drop = self.as_root and not self.setpriv   # as 65534, so that RLIMIT_NPROC applies (root ignores it)
            if self.as_root and self.setpriv:
                cmd = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *cmd]
            preexec = None if self.prlimit else _preexec(limits, 1 if self.bwrap_base else 0)
            started = time.monotonic()
            try:
                proc = subprocess.Popen(
                    cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
                    pass_fds=[fd for fd in keep if fd not in (stdin, info_r)], start_new_session=True,
                    preexec_fn=preexec, **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if drop else {}))
            except OSError as exc:
                raise SandboxError(f"could not start the sandboxed process ({exc}); check that {cmd[0]} exists "
                                   "and is executable") from exc
            if info_w is not None:
                os.close(info_w)
                keep.remove(info_w)
            out, err, init_pidfd, timed_out, truncated = drive(proc, limits, started, info_r)
            if init_pidfd is not None:
                # Kill the namespace (its init) first, so that bwrap reaps the init and exits:
                # killing bwrap first would leave the init a zombie under the host's pid 1.
                keep.append(init_pidfd)
                kill_and_wait(init_pidfd)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if proc.returncode is None:   # not reaped yet, so its group id is still ours
                kill_group(proc.pid)
            returncode = proc.wait()
            wall = time.monotonic() - started
        finally:
            for fd in keep:
                _close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        term = -returncode if returncode < 0 else None
        if self.bwrap_base and returncode > 128 and returncode - 128 in _SIGNALS:
            term = returncode - 128   # bwrap reports a signal death of the program as 128 + signal
        return make_result(returncode=returncode, term_signal=term, stdout=out, stderr=err,
                           timed_out=timed_out, truncated=truncated, wall=wall)

    # -- warm jails -------------------------------------------------------------------------
    def _try_warm(self) -> bool:
        try:
            # The sandbox's own disk size, so that the probe's jail is the first one used.
            probe = self._run_warm(Program({"main.py": "import sys; print(sys.version_info[0])"}),
                                   SandboxLimits(wall_seconds=20, cpu_seconds=10, disk_mb=self.limits.disk_mb))
        except (SandboxError, OSError) as exc:
            problem = str(exc)
        else:
            if probe.stdout.strip() == "3" and probe.exit_code == 0:
                return True
            problem = (probe.stderr.strip() or f"exit {probe.exit_code}, signal {probe.signal}")[-500:]
        log.warning("rftgym local sandbox: warm jails do not work here (%s); using one jail per run", problem)
        return False

    def _run_warm(self, program: Program, limits: SandboxLimits) -> ExecResult:
        argv = list(program.argv)
        script = argv[0] in PYTHON_NAMES and len(argv) > 1 and not argv[1].startswith("-")
        if argv[0] in PYTHON_NAMES and not script:
            argv = [self.python, "-E", "-s", *argv[1:]]
        request = {"files": dict(program.files), "argv": argv, "script": script,
                   # no POSIX message queues: they would outlive the run in the jail's ipc namespace
                   "rlimits": {**rlimits(limits, nproc_extra=1), "msgqueue": (0, 0)}}
        for attempt in range(2):
            jail = self._take_jail(limits.disk_mb)
            try:
                outcome = jail.run(request, program.stdin.encode(), limits)
                break
            except JailBroken as exc:   # it died while idle: a fresh one, once
                jail.kill()
                if attempt:
                    raise SandboxError(f"a fresh warm jail broke before the program started ({exc}); "
                                       "pass warm_jails=False to use one jail per run") from exc
        killed = outcome.status is None or outcome.timed_out or outcome.truncated
        returncode = -signal.SIGKILL if killed else os.waitstatus_to_exitcode(outcome.status)
        result = make_result(returncode=returncode, term_signal=-returncode if returncode < 0 else None,
                             stdout=outcome.stdout, stderr=outcome.stderr, timed_out=outcome.timed_out,
                             truncated=outcome.truncated, wall=outcome.wall)
        # A limit that may leave the jail strained (memory, disk) or anything unusual: a fresh jail.
        recycle = (killed or outcome.dirty is not None or result.limit_hit in ("memory", "file_size")
                   or jail.runs >= RECYCLE_AFTER)
        if outcome.dirty:
            log.debug("warm jail replaced: %s", outcome.dirty)
        self._release(jail, recycle)
        return result

    def _take_jail(self, disk_mb: int) -> WarmJail:
        while True:
            with self._jail_lock:
                jail = next((j for j in self._idle if j.disk_mb == disk_mb), None)
                if jail is not None:
                    self._idle.remove(jail)
            if jail is None:
                return self._start_jail(disk_mb)
            if jail.alive():
                return jail
            jail.kill()

    def _release(self, jail: WarmJail, recycle: bool) -> None:
        evicted = jail
        with self._jail_lock:
            if not recycle and not self._closed:
                self._idle.append(jail)   # the most recently used last; the oldest goes when too many
                evicted = self._idle.pop(0) if len(self._idle) > self.workers else None
        if evicted is not None:
            evicted.kill()

    def _start_jail(self, disk_mb: int) -> WarmJail:
        keep: list[int] = []
        host_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r, info_w = os.pipe()
        keep += [jail_end.detach(), info_w]
        # No --die-with-parent: its signal fires when the *thread* that started bwrap exits, and
        # jails outlive threads. The zygote exits (ending the namespace) when host_end closes.
        base = [a for a in self.bwrap_base if a != "--die-with-parent"]
        cmd = [*self._jail_mounts(base, disk_mb, keep), "--as-pid-1", *self._jail_settings(str(info_w)),
               "--", self.python, "-E", "-s", "-c", ZYGOTE_SOURCE, str(keep[0])]
        drop = self.as_root and not self.setpriv
        if self.as_root and self.setpriv:
            cmd = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--", *cmd]
        try:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={"PATH": JAIL_PATH}, pass_fds=keep, start_new_session=True,
                **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if drop else {}))
        except OSError as exc:
            host_end.close()
            raise SandboxError(f"could not start a warm jail ({exc}); check that {cmd[0]} exists") from exc
        finally:
            for fd in keep:
                _close(fd)
        jail = WarmJail(proc, host_end, disk_mb)
        try:
            jail.wait_ready(info_r)
        except JailBroken as exc:
            jail.kill()
            raise SandboxError(f"a warm jail did not start ({exc}); pass warm_jails=False to use one "
                               "jail per run") from exc
        finally:
            _close(info_r)
        return jail

    def close(self) -> None:
        super().close()
        with self._jail_lock:
            idle, self._idle = self._idle, []
        for jail in idle:
            jail.kill()

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


class JailBroken(Exception):
    """A warm jail stopped working before a program started in it (internal: the caller retries)."""


@dataclass(frozen=True)
class WarmOutcome:
    status: int | None     # the run's wait status; None when the jail was killed or died
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    dirty: str | None      # why the jail must be replaced, if it must
    wall: float


class WarmJail:
    """One long-lived bwrap jail whose zygote (:mod:`.jail_server`, pid 1 there) forks each run.

    Used by one thread at a time. The host keeps the wall-clock limit and the output caps: the
    program's stdout and stderr are pipes read here, and the jail is killed when a limit is hit
    or the zygote does not report in time."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, disk_mb: int):
        self.proc, self.sock, self.disk_mb = proc, sock, disk_mb
        sock.settimeout(START_SECONDS)   # for sends; the fd stays non-blocking, reads are polled
        self.pidfd: int | None = None   # of the zygote, the namespace's init
        self.runs = 0
        self._report = bytearray()

    def wait_ready(self, info_fd: int) -> None:
        deadline = time.monotonic() + START_SECONDS
        info = b""
        while self.pidfd is None:
            ready, _, _ = select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(info_fd, 4096) if ready else b""
            if not chunk:
                raise JailBroken("bwrap exited or timed out before reporting its child")
            info += chunk
            self.pidfd = _pidfd(info)
        report = self._read_report(deadline)
        if report != {"ready": True}:
            raise JailBroken(f"the zygote said {report!r} instead of ready")

    def _read_report(self, deadline: float):
        while b"\n" not in self._report:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            chunk = self.sock.recv(4096) if ready else b""
            if not chunk:
                raise JailBroken("the zygote hung up or did not answer in time")
            self._report += chunk
        line, _, rest = bytes(self._report).partition(b"\n")
        self._report = bytearray(rest)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def alive(self) -> bool:
        return self.pidfd is not None and not select.select([self.pidfd], [], [], 0)[0]

    def run(self, request: dict, stdin: bytes, limits: SandboxLimits) -> WarmOutcome:
        keep: list[int] = []
        try:
            stdin_fd = _memfd(stdin, keep, as_int=True)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            keep += [out_r, out_w, err_r, err_w]
            payload = json.dumps(request).encode()
            data = struct.pack("!I", len(payload)) + payload
            started = time.monotonic()
            try:
                sent = socket.send_fds(self.sock, [data[:1 << 16]], [stdin_fd, out_w, err_w])
                self.sock.sendall(data[sent:])
            except OSError as exc:
                raise JailBroken(f"could not send the program: {exc}") from exc
            self.runs += 1
            for fd in (stdin_fd, out_w, err_w):   # the zygote has its own copies now
                keep.remove(fd)
                _close(fd)
            return self._collect(out_r, err_r, limits, started)
        finally:
            for fd in keep:
                _close(fd)

    def _collect(self, out_r: int, err_r: int, limits: SandboxLimits, started: float) -> WarmOutcome:
        """Read both outputs (capped) and the zygote's report, until both pipes close after the
        report, or the wall limit, or the cap."""
        streams = {out_r: bytearray(), err_r: bytearray()}
        sock = self.sock.fileno()
        poller = select.poll()
        for fd in (out_r, err_r, sock):
            if fd != sock:
                os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        open_fds = {out_r, err_r, sock}
        deadline = started + limits.wall_seconds
        cap = limits.output_bytes
        status = dirty = reported_at = None
        timed_out = truncated = False
        while open_fds - {sock} or (reported_at is None and sock in open_fds):
            now = time.monotonic()
            if reported_at is not None and now - reported_at > DRAIN_SECONDS:
                dirty = dirty or "the output pipes stayed open after the run"
                break
            if reported_at is None and now >= deadline:
                timed_out = True
                break
            for fd, _ in poller.poll(max(1, int(min(deadline - now, 0.05) * 1000))):
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    if fd == sock and reported_at is None:   # the zygote died: the namespace with it
                        reported_at, dirty = time.monotonic(), "the zygote died"
                elif fd == sock:
                    self._report += chunk
                    if b"\n" in self._report:
                        reported_at = time.monotonic()
                        status, dirty = _parse_report(self._read_report(reported_at))
                else:
                    streams[fd] += chunk
                    truncated = truncated or len(streams[fd]) > cap
            if truncated:
                break
        wall = (reported_at or time.monotonic()) - started
        out, err = (bytes(b[:cap]) for b in streams.values())
        return WarmOutcome(status, out, err, timed_out, truncated, dirty, wall)

    def kill(self) -> None:
        """End the jail: SIGKILL to its init ends the whole pid namespace; bwrap then exits."""
        if self.proc.returncode is not None:
            return   # already ended (and bwrap reaped: its pid may belong to someone else now)
        if self.pidfd is not None:
            kill_and_wait(self.pidfd)
        else:
            kill_group(self.proc.pid)
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.pidfd is not None:
            _close(self.pidfd)
            self.pidfd = None


def _parse_report(report) -> tuple[int | None, str | None]:
    """(wait status, why the jail is dirty or None), distrusting the zygote's JSON."""
    if not isinstance(report, dict) or not isinstance(report.get("status"), int) or isinstance(
            report.get("status"), bool):
        return None, f"bad report {str(report)[:200]}"
    dirty = report.get("dirty")
    return report["status"], dirty if dirty is None else str(dirty)[:500]


def rlimits(limits: SandboxLimits, nproc_extra: int = 0) -> dict[str, tuple[int, int]]:
    """prlimit names -> (soft, hard). The CPU soft limit sends SIGXCPU a second before SIGKILL."""
    cpu = max(1, math.ceil(limits.cpu_seconds))
    nproc = limits.processes + nproc_extra
    return {"cpu": (cpu, cpu + 1), "as": (limits.memory_mb * MB,) * 2, "fsize": (limits.file_size_mb * MB,) * 2,
            "nofile": (limits.open_files,) * 2, "nproc": (nproc, nproc), "core": (0, 0)}


_RESOURCE = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE,
             "nofile": resource.RLIMIT_NOFILE, "nproc": resource.RLIMIT_NPROC, "core": resource.RLIMIT_CORE}


def _preexec(limits: SandboxLimits, nproc_extra: int):
    """Without prlimit: set the rlimits in the child before exec (slower: no vfork)."""
    values = rlimits(limits, nproc_extra)

    def apply():
        for name, pair in values.items():
            resource.setrlimit(_RESOURCE[name], pair)
    return apply


def drive(proc: subprocess.Popen, limits: SandboxLimits, started: float, info_fd: int | None):
    """Read stdout and stderr (each capped) and ``info_fd`` until EOF, the wall limit, or the
    output cap. Returns (stdout, stderr, pidfd of bwrap's namespace init or None, timed_out,
    truncated). Never reaps ``proc``."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    info = bytearray()
    pidfd = None
    poller = select.poll()
    for fd in [*streams, *([info_fd] if info_fd is not None else [])]:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    open_fds = set(streams) | ({info_fd} if info_fd is not None else set())
    deadline = started + limits.wall_seconds
    cap = limits.output_bytes
    timed_out = truncated = False
    exited_at = None
    while open_fds & set(streams):
        now = time.monotonic()
        if now >= deadline:
            timed_out = True
            break
        if exited_at is not None and now - exited_at > 0.2:
            break   # the program is gone; something it left behind still holds the pipes
        for fd, _ in poller.poll(max(1, int(min(deadline - now, 0.05) * 1000))):
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                poller.unregister(fd)
                open_fds.discard(fd)
            elif fd == info_fd:
                info += chunk
                if pidfd is None:
                    pidfd = _pidfd(bytes(info))
            else:
                streams[fd] += chunk
                truncated = truncated or len(streams[fd]) > cap
        if truncated:
            break
        if exited_at is None and _exited(proc.pid):
            exited_at = time.monotonic()
            kill_group(proc.pid)
    if info_fd in open_fds and pidfd is None:
        try:
            pidfd = _pidfd(bytes(info) + os.read(info_fd, 1 << 12))
        except OSError:
            pass
    out, err = (bytes(b[:cap]) for b in streams.values())
    return out, err, pidfd, timed_out, truncated


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it (so its group id stays ours to kill)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_and_wait(pidfd: int, timeout: float = 5.0) -> None:
    """SIGKILL bwrap's namespace init and wait until it (hence its whole pid namespace) is gone."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    select.select([pidfd], [], [], timeout)


def _pidfd(info: bytes) -> int | None:
    """A pidfd of the namespace init named in bwrap's --info-fd JSON, opened as soon as it is
    known (bwrap, its parent, is alive then and has not reaped it, so the pid is not reused)."""
    child = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
    if child is None:
        return None
    try:
        return os.pidfd_open(int(child.group(1)))
    except OSError:
        return None


def _memfd(data: bytes, keep: list[int], as_int: bool = False):
    fd = os.memfd_create("rftgym-sandbox", os.MFD_CLOEXEC)
    keep.append(fd)
    if data:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    return fd if as_int else str(fd)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _warn_fallback(problem: str) -> None:
    global _warned_fallback
    if _warned_fallback:
        return
    _warned_fallback = True
    message = (f"rftgym local sandbox: bubblewrap is not in use ({problem}). Programs run with rlimits, a process "
               "group and a temp dir only: NO network isolation, NO filesystem isolation, daemons may survive. "
               f"To fix: {INSTALL_HINT}.")
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
