"""One sandbox per backend per process, shared by every code env in it.

A sandbox is not cheap: the local backend probes bubblewrap when it is made and keeps up to one
warm jail per worker; the docker backend holds a client and an image. ``rftgym eval --num-envs
16`` makes 16 envs, and with a sandbox each that was 16 probes and up to 32 idle jails competing
for the same cores. :func:`shared_sandbox` instead hands each env a :class:`SandboxView` of one
sandbox per backend: the view carries the env's own limits (every program it runs gets them,
unless the program names its own) and closing it (or dropping it) releases the env's share. The
last release closes the sandbox, and the next env makes a fresh one.

A forked child (e.g. a subprocess vector env) never uses the parent's sandbox: its jails' sockets
and threads belong to the parent. The registry is keyed by process id and starts afresh in a
child (with a fresh lock, in case another thread held it at the fork).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Sequence

from ...core.errors import ConfigError
from .sandbox import (
    ExecResult,
    Program,
    Sandbox,
    SandboxError,
    SandboxLimits,
    make_sandbox,
)

# Reentrant: a view's finalizer (which takes it) may run from a garbage collection in this thread.
_lock = threading.RLock()
_shared: dict[tuple[int, str], list] = {}  # (pid, backend) -> [sandbox, number of open views]


def _forget_after_fork() -> None:
    # A child forked while another thread held the lock (say, starting a sandbox) would wait for
    # it forever; and the parent's sandboxes are not the child's to use. Start afresh.
    global _lock
    _lock = threading.RLock()
    _shared.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _release(key: tuple[int, str], inner: Sandbox) -> None:
    """Give back one share of ``inner``; the last one closes it."""
    with _lock:
        entry = _shared.get(key)
        if entry is None or entry[0] is not inner:
            return
        entry[1] -= 1
        last = entry[1] == 0
        if last:
            del _shared[key]
    if last:
        inner.close()


class SandboxView(Sandbox):
    """A share of a process-wide sandbox, with its own limits. Closing it (or dropping it)
    releases the share."""

    def __init__(self, inner: Sandbox, key: tuple[int, str], limits: SandboxLimits | None):
        super().__init__(limits=limits, workers=inner.workers)
        self.inner = inner
        self.name, self.isolated = inner.name, inner.isolated
        # Runs once: on close(), or when the view is garbage-collected without one.
        self._release = weakref.finalize(self, _release, key, inner)

    @property
    def isolation(self) -> str:
        """The shared sandbox's, as it is now (a local one's changes once a retried probe of its
        inode cap runs)."""
        return self.inner.isolation

    def _limited(self, program: Program) -> Program:
        return program if program.limits is not None else dataclasses.replace(program, limits=self.limits)

    def run(self, program: Program) -> ExecResult:
        self._check_open()
        return self.inner.run(self._limited(program))

    def run_many(self, programs: Sequence[Program]) -> list[ExecResult]:
        self._check_open()
        return self.inner.run_many([self._limited(p) for p in programs])

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"this {self.name} sandbox is closed; make a new one")

    def close(self) -> None:
        self._closed = True
        self._release()


def shared_sandbox(backend: str = "local", *, limits: SandboxLimits | None = None,
                   require_isolation: bool = False) -> SandboxView:
    """A view of this process's sandbox for ``backend`` (made on first use), with ``limits``;
    ``require_isolation``: a SandboxError instead of a local sandbox without bubblewrap."""
    if backend == "auto":
        from .sandbox_docker import docker_reachable

        backend = "docker" if docker_reachable() else "local"
    if limits is not None and not isinstance(limits, SandboxLimits):
        raise ConfigError(f"limits must be a SandboxLimits or None, got {limits!r}")
    key = (os.getpid(), backend)
    with _lock:
        entry = _shared.get(key)
        if entry is None:
            # Made under the lock so that envs built on several threads at once share one.
            entry = _shared[key] = [make_sandbox(backend), 0]
        entry[1] += 1
    try:
        if require_isolation and not entry[0].isolated:
            from .sandbox_local import INSTALL_HINT

            raise SandboxError(
                f"require_isolation=True, but the {backend} sandbox has none ({entry[0].isolation}); a program "
                f"there can read the host's files (the benchmark's own solutions) and reach the network. "
                f"To fix: {INSTALL_HINT}; or use sandbox='docker'; or, knowing this, set require_isolation=False")
        return SandboxView(entry[0], key, limits)
    except BaseException:
        _release(key, entry[0])
        raise


def open_shares(backend: str) -> int:
    """How many views of this process's ``backend`` sandbox are open (0: none exists)."""
    with _lock:
        entry = _shared.get((os.getpid(), backend))
        return entry[1] if entry else 0
