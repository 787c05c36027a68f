"""The host side of the local sandbox's warm jails: a pool of long-lived bubblewrap jails.

Each :class:`WarmJail` is one bwrap jail whose supervisor is the zygote (:mod:`.jail_server`). Per run
the host writes the request (files, argv, rlimits) into a sealed memfd and sends it over a unix
socket as an fd, with the run's stdin, stdout and stderr fds, attached to one control byte (the
zygote only forks; the forked child reads the request, so no run's data is ever in the memory
later runs are forked from). It then reads the outputs (capped) and the zygote's fixed-size
report (wait status, dirty or not). The host keeps the wall-clock limit and the output caps. :class:`WarmJails` keeps at most one idle
jail per worker and replaces a jail when the zygote dies or does not report in time, when a run
hits the wall, output, memory or disk limit, when the zygote's clean-up finds anything off, and
every ``RECYCLE_AFTER`` runs. A run whose namespaces the zygote could not set up never started the
program: it is not the program's result, so it runs again in a fresh jail, once, and then raises
:class:`~.sandbox.SandboxError`.

:class:`~.sandbox_local.LocalSandbox` builds the bwrap command line (it knows the mounts and the
user to run as) and hands this module a ``spawn`` function. The fd and process helpers at the
bottom are shared with its cold path, which imports them from here (this module imports nothing
from :mod:`.sandbox_local`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .jail_server import CLEAN_SECONDS, CLEANED, CONTROL, DIRTY, EXITED, NOT_SET_UP, READY, REPORT, SUPERVISORS
from .memory_cgroup import MemoryGroup, run_cap_mb
from .sandbox import (DEFAULT_HASH_SEED, PYTHON_NAMES, ExecResult, Program, SandboxError, SandboxLimits, make_result,
                      next_time_limit, python_command, python_environment)

log = logging.getLogger(__name__)
MB = 1 << 20
RECYCLE_AFTER = 200   # runs per warm jail before it is replaced anyway
START_SECONDS = 30.0  # for a warm jail to start and report ready
DRAIN_SECONDS = 0.5   # for the output pipes to close once the zygote has reported a clean jail
# After the program exits, how long the zygote may take to clean the jail (its own limit is
# CLEAN_SECONDS); not part of the run's wall time.
CLEANUP_WAIT_SECONDS = CLEAN_SECONDS + 3.0
ZYGOTE_SOURCE = (Path(__file__).parent / "jail_server.py").read_text(encoding="utf-8")

# spawn(disk_mb, keep, zygote_fd, info_fd, memory_group) -> the started bwrap process, in the
# memory group if one is given. ``keep`` holds fds the command passes to bwrap (memfds); the pool
# closes them, and the two fds, once bwrap has started.
Spawn = Callable[[int, list, int, int, "MemoryGroup | None"], subprocess.Popen]
# memory_group(limits) -> a fresh memory cgroup capped for a run with these limits, or None.
NewMemoryGroup = Callable[[SandboxLimits], "MemoryGroup | None"]


class JailBroken(Exception):
    """A warm jail stopped working before a program started in it (internal: the caller retries)."""


@dataclass(frozen=True)
class WarmOutcome:
    status: int | None     # the run's wait status; None when the jail was killed or died
    stdout: bytes
    stderr: bytes
    timed_out: str | None  # the time limit that stopped the run ("wall" or "quiet"), if one did
    truncated: bool
    dirty: str | None      # why the jail must be replaced, if it must
    wall: float
    oom_killed: bool = False   # the kernel killed a process of the jail for going over its memory cap


class WarmJails:
    """The warm jails of one sandbox: takes an idle one (or starts one) per run, and keeps at
    most ``capacity`` idle, each for the disk size it was made with. Each jail is in its own
    memory cgroup where ``memory_group`` makes one, capped anew for each run. Thread-safe."""

    def __init__(self, spawn: Spawn, capacity: int, python: str, memory_group: NewMemoryGroup | None = None):
        self.spawn, self.capacity, self.python = spawn, capacity, python
        self.memory_group = memory_group
        self.idle: list[WarmJail] = []   # the most recently used last
        self._lock = threading.Lock()
        self._closed = False
        # A sandbox dropped without close() still ends its jails (and closes their sockets).
        self._finalizer = weakref.finalize(self, _kill_all, self.idle)

    def run(self, program: Program, limits: SandboxLimits) -> ExecResult:
        argv = list(program.argv)
        # A script runs in the zygote's forked interpreter, whose hash seed is the default one; with
        # any other seed (or other interpreter flags) the program's Python is exec'd afresh.
        script = argv[0] in PYTHON_NAMES and len(argv) > 1 and not argv[1].startswith("-") \
            and program.hash_seed == DEFAULT_HASH_SEED
        if argv[0] in PYTHON_NAMES and not script:
            argv = python_command(self.python, argv[1:])
        request = {"files": dict(program.files), "argv": argv, "script": script,
                   "environment": python_environment(program.hash_seed),
                   # no POSIX message queues: RLIMIT_AS does not count their memory
                   "rlimits": {**rlimits(limits, nproc_extra=SUPERVISORS), "msgqueue": (0, 0)}}
        for attempt in range(2):
            jail = self._take(limits)
            try:
                outcome = jail.run(request, program.stdin.encode(), limits)
                break
            except JailBroken as exc:   # it died while idle, or could not set the run up: a fresh one, once
                jail.kill()
                if attempt:
                    raise SandboxError(f"a fresh warm jail broke before the program started ({exc}); "
                                       "pass warm_jails=False to use one jail per run") from exc
            except BaseException:   # an OSError, an interrupt: the jail's state is unknown
                jail.kill()
                raise
        killed = outcome.status is None or outcome.timed_out or outcome.truncated
        returncode = -signal.SIGKILL if killed else os.waitstatus_to_exitcode(outcome.status)
        result = make_result(returncode=returncode, term_signal=-returncode if returncode < 0 else None,
                             stdout=outcome.stdout, stderr=outcome.stderr, timed_out=outcome.timed_out,
                             truncated=outcome.truncated, wall=outcome.wall, oom_killed=outcome.oom_killed)
        # A limit that may leave the jail strained (memory, disk) or anything unusual: a fresh jail.
        recycle = (killed or outcome.dirty is not None or result.limit_hit in ("memory", "file_size")
                   or jail.runs >= RECYCLE_AFTER)
        if outcome.dirty:
            log.debug("warm jail replaced: %s", outcome.dirty)
        self._release(jail, recycle)
        return result

    def _take(self, limits: SandboxLimits) -> WarmJail:
        while True:
            with self._lock:
                jail = next((j for j in self.idle if j.disk_mb == limits.disk_mb), None)
                if jail is not None:
                    self.idle.remove(jail)
            if jail is None:
                return self._start(limits)
            if jail.alive():
                return jail
            jail.kill()

    def _release(self, jail: WarmJail, recycle: bool) -> None:
        evicted = jail
        with self._lock:
            if not recycle and not self._closed:
                self.idle.append(jail)
                evicted = self.idle.pop(0) if len(self.idle) > self.capacity else None
        if evicted is not None:
            evicted.kill()

    def _start(self, limits: SandboxLimits) -> WarmJail:
        keep: list[int] = []   # fds to close here whatever happens (bwrap has its own copies)
        host_end = info_r = group = None
        try:
            group = self.memory_group(limits) if self.memory_group else None
            host_end, jail_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            keep.append(jail_end.detach())
            info_r, info_w = os.pipe()
            keep.append(info_w)
            proc = self.spawn(limits.disk_mb, keep, keep[0], info_w, group)
        except BaseException:
            if host_end is not None:
                host_end.close()
            if group is not None:
                group.remove()
            close_fd(info_r)
            raise
        finally:
            for fd in keep:
                close_fd(fd)
        jail = WarmJail(proc, host_end, limits.disk_mb, group)
        try:
            jail.wait_ready(info_r)
        except BaseException as exc:
            jail.kill()
            if isinstance(exc, (JailBroken, OSError)):
                raise SandboxError(f"a warm jail did not start ({exc}); pass warm_jails=False to use one "
                                   "jail per run") from exc
            raise
        finally:
            close_fd(info_r)
        return jail

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = self.idle[:]
            self.idle.clear()
        for jail in idle:
            jail.kill()


def _kill_all(jails: list[WarmJail]) -> None:
    for jail in jails[:]:
        jail.kill()
    jails.clear()


class WarmJail:
    """One long-lived bwrap jail whose zygote (:mod:`.jail_server`) forks each run.

    Used by one thread at a time. The program's stdout and stderr are pipes read here; the jail
    is killed when a limit is hit or the zygote does not report in time."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, disk_mb: int,
                 memory_group: MemoryGroup | None = None):
        self.proc, self.sock, self.disk_mb, self.memory_group = proc, sock, disk_mb, memory_group
        sock.settimeout(START_SECONDS)   # for sends; the fd stays non-blocking, reads are polled
        self.pidfd: int | None = None   # of the jail's init (the zygote's parent): killing it ends the jail
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
            self.pidfd = init_pidfd(info)
        while (report := self._take_report()) is None:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            chunk = self.sock.recv(4096) if ready else b""
            if not chunk:
                raise JailBroken("the zygote hung up or did not answer in time")
            self._report += chunk
        if report != REPORT.pack(READY, 0, 0):
            raise JailBroken(f"the zygote said {report!r} instead of ready")

    def _take_report(self) -> bytes | None:
        """The next whole fixed-size report received, if any."""
        if len(self._report) < REPORT.size:
            return None
        report = bytes(self._report[:REPORT.size])
        del self._report[:REPORT.size]
        return report

    def alive(self) -> bool:
        return self.pidfd is not None and not select.select([self.pidfd], [], [], 0)[0]

    def run(self, request: dict, stdin: bytes, limits: SandboxLimits) -> WarmOutcome:
        keep: list[int] = []
        self._cap_for(limits)
        try:
            request_fd = memfd(json.dumps(request).encode(), keep, seal=True)
            stdin_fd = memfd(stdin, keep)
            out_r, out_w = pipe(keep)
            err_r, err_w = pipe(keep)
            started = time.monotonic()
            try:
                sent = socket.send_fds(self.sock, [CONTROL], [request_fd, stdin_fd, out_w, err_w])
            except OSError as exc:
                raise JailBroken(f"could not send the program: {exc}") from exc
            if sent != len(CONTROL):
                raise JailBroken("could not send the program: the socket took nothing")
            self.runs += 1
            for fd in (request_fd, stdin_fd, out_w, err_w):   # the zygote has its own copies now
                keep.remove(fd)
                close_fd(fd)
            outcome = self._collect(out_r, err_r, limits, started)
            # Any OOM kill recycles the jail (a memory limit hit), so a jail run again has none before.
            if self.memory_group is not None and self.memory_group.oom_kills() > 0:
                outcome = replace(outcome, oom_killed=True)
        finally:
            for fd in keep:
                close_fd(fd)
        if outcome.dirty == NOT_SET_UP:   # the program never ran: a broken jail, not the program's result
            detail = outcome.stderr.decode("utf-8", "replace").strip()[-300:]
            raise JailBroken(f"{NOT_SET_UP}: {detail}" if detail else NOT_SET_UP)
        return outcome

    def _cap_for(self, limits: SandboxLimits) -> None:
        """Cap the jail's memory group, if it has one, for a run with ``limits`` (nothing to write
        when the last run's limits were the same)."""
        if self.memory_group is None:
            return
        try:
            self.memory_group.cap(run_cap_mb(limits.memory_mb, limits.disk_mb) * MB)
        except OSError as exc:   # e.g. the jail holds more than the new cap allows
            raise JailBroken(f"could not cap the jail's memory cgroup: {exc}") from exc

    def _collect(self, out_r: int, err_r: int, limits: SandboxLimits, started: float) -> WarmOutcome:
        """Read both outputs (capped) and the zygote's two reports, until both pipes close after the
        jail is reported clean, or the wall limit (which ends when the program exits, not when the
        jail is clean), or the cap."""
        streams = {out_r: bytearray(), err_r: bytearray()}
        sock = self.sock.fileno()
        poller = select.poll()
        for fd in (out_r, err_r, sock):
            if fd != sock:
                os.set_blocking(fd, False)
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        open_fds = {out_r, err_r, sock}
        cap = limits.output_bytes
        status = dirty = exited_at = cleaned_at = timed_out = None
        truncated = False
        last_output = started
        while open_fds - {sock} or (cleaned_at is None and sock in open_fds):
            now = time.monotonic()
            if exited_at is None:
                until, limit = next_time_limit(limits, started, last_output)
                if now >= until:
                    timed_out = limit
                    break
            elif cleaned_at is None:
                until = exited_at + CLEANUP_WAIT_SECONDS
                if now >= until:
                    dirty = dirty or "the jail was not reported clean in time"
                    break
            else:
                until = cleaned_at + DRAIN_SECONDS
                if now >= until:
                    dirty = dirty or "the output pipes stayed open after the run"
                    break
            for fd, chunk in read_ready(poller, open_fds, min(until - now, 0.05)):
                if not chunk:
                    if fd == sock and cleaned_at is None:   # the zygote died: the namespace with it
                        exited_at = exited_at or time.monotonic()
                        cleaned_at, dirty = time.monotonic(), dirty or "the zygote died"
                elif fd == sock:
                    self._report += chunk
                    while (report := self._take_report()) is not None:
                        if exited_at is None:
                            exited_at = time.monotonic()
                            status, problem = _parse_report(report, EXITED)
                        else:
                            _, problem = _parse_report(report, CLEANED if cleaned_at is None else b"")
                            cleaned_at = cleaned_at or time.monotonic()
                        dirty = dirty or problem
                        if problem:   # a zygote that breaks protocol is not waited for
                            cleaned_at = cleaned_at or time.monotonic()
                else:
                    streams[fd] += chunk
                    last_output = time.monotonic()
                    truncated = truncated or len(streams[fd]) > cap
            if truncated:
                break
        wall = (exited_at or time.monotonic()) - started
        out, err = (bytes(b[:cap]) for b in streams.values())
        return WarmOutcome(status, out, err, timed_out, truncated, dirty, wall)

    def kill(self) -> None:
        """End the jail: SIGKILL to its init ends the whole pid namespace; bwrap then exits.
        Safe to call twice; always closes the socket and the pidfd."""
        if self.proc.returncode is None:   # once reaped, bwrap's pid may belong to someone else
            if self.pidfd is not None:
                kill_and_wait(self.pidfd)
            else:
                kill_group(self.proc.pid)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()   # a zygote that somehow survived exits on hang-up
        if self.pidfd is not None:
            close_fd(self.pidfd)
            self.pidfd = None
        if self.memory_group is not None:
            self.memory_group.remove()


def _parse_report(report: bytes, expected: bytes) -> tuple[int | None, str | None]:
    """(wait status, why the jail is dirty or None) from an ``expected`` report (EXITED: the
    program's wait status; CLEANED: what is off), distrusting the zygote."""
    tag, status, dirty = REPORT.unpack(report)
    try:
        os.waitstatus_to_exitcode(status)
    except ValueError:
        return None, f"bad report {report!r}"
    if tag != expected or not 0 <= dirty < len(DIRTY) or (tag == EXITED and dirty):
        return None, f"bad report {report!r}"
    return (status if tag == EXITED else None), DIRTY[dirty]


# -- fd and process helpers, shared with the cold path ---------------------------------------
def read_ready(poller, open_fds: set[int], timeout: float):
    """``(fd, chunk)`` for each registered non-blocking fd with data within ``timeout`` seconds;
    ``chunk`` is ``b""`` at end of file, and that fd is then unregistered and dropped from ``open_fds``."""
    for fd, _ in poller.poll(max(1, int(timeout * 1000))):
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            continue
        if not chunk:
            poller.unregister(fd)
            open_fds.discard(fd)
        yield fd, chunk


def rlimits(limits: SandboxLimits, nproc_extra: int = 0) -> dict[str, tuple[int, int]]:
    """prlimit names -> (soft, hard). The CPU soft limit sends SIGXCPU a second before SIGKILL."""
    cpu = max(1, math.ceil(limits.cpu_seconds))
    nproc = limits.processes + nproc_extra
    return {"cpu": (cpu, cpu + 1), "as": (limits.memory_mb * MB,) * 2, "fsize": (limits.file_size_mb * MB,) * 2,
            "nofile": (limits.open_files,) * 2, "nproc": (nproc, nproc), "core": (0, 0)}


def memfd(data: bytes, keep: list[int], seal: bool = False) -> int:
    """A close-on-exec memfd holding ``data``, rewound; added to ``keep`` (the caller closes it).
    ``seal``: sealed against any change, so that what the reader sees is what was written."""
    fd = os.memfd_create("rftgym-sandbox", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seal else 0))
    keep.append(fd)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)
    return fd


def pipe(keep: list[int]) -> tuple[int, int]:
    """os.pipe(), both ends added to ``keep`` at once (so no error path can lose one)."""
    read_end, write_end = os.pipe()
    keep += [read_end, write_end]
    return read_end, write_end


def close_fd(fd: int | None) -> None:
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass


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


def init_pidfd(info: bytes) -> int | None:
    """A pidfd of the namespace init named in bwrap's --info-fd JSON, opened as soon as it is
    known (bwrap, its parent, is alive then and has not reaped it, so the pid is not reused)."""
    child = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
    if child is None:
        return None
    try:
        return os.pidfd_open(int(child.group(1)))
    except OSError:
        return None
