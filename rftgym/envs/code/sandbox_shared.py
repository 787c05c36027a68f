"""One sandbox per backend per process, shared by every code env in it.

A sandbox is not cheap: the local backend probes bubblewrap when it is made and keeps up to one
warm jail per worker; the docker backend holds a client and an image. ``rftgym eval --num-envs
16`` makes 16 envs, and with a sandbox each that was 16 probes and up to 32 idle jails competing
for the same cores. :func:`shared_sandbox` instead hands each env a :class:`SandboxView` of one
sandbox per backend: the view carries the env's own limits (every program it runs gets them,
unless the program names its own) and closing it releases the env's share. The last release
closes the sandbox, and the next env makes a fresh one.

A forked child (e.g. a subprocess vector env) never uses the parent's sandbox: its jails' sockets
and threads belong to the parent. The registry is keyed by process id.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence

from .sandbox import (
    ExecResult,
    Program,
    Sandbox,
    SandboxError,
    SandboxLimits,
    make_sandbox,
)

_lock = threading.Lock()
_shared: dict[tuple[int, str], list] = {}  # (pid, backend) -> [sandbox, number of open views]


class SandboxView(Sandbox):
    """A share of a process-wide sandbox, with its own limits. Closing it releases the share."""

    def __init__(self, inner: Sandbox, key: tuple[int, str], limits: SandboxLimits | None):
        super().__init__(limits=limits, workers=inner.workers)
        self.inner, self._key = inner, key
        self.name, self.isolation = inner.name, inner.isolation

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
        with _lock:
            if self._closed:
                return
            self._closed = True
            entry = _shared.get(self._key)
            last = entry is not None and entry[0] is self.inner and entry[1] == 1
            if entry is not None and entry[0] is self.inner:
                entry[1] -= 1
                if last:
                    del _shared[self._key]
        if last:
            self.inner.close()


def shared_sandbox(backend: str = "local", *, limits: SandboxLimits | None = None) -> SandboxView:
    """A view of this process's sandbox for ``backend`` (made on first use), with ``limits``."""
    if backend == "auto":
        from .sandbox_docker import docker_reachable

        backend = "docker" if docker_reachable() else "local"
    key = (os.getpid(), backend)
    with _lock:
        entry = _shared.get(key)
        if entry is None:
            # Made under the lock so that envs built on several threads at once share one.
            entry = _shared[key] = [make_sandbox(backend), 0]
        entry[1] += 1
        return SandboxView(entry[0], key, limits)


def open_shares(backend: str) -> int:
    """How many views of this process's ``backend`` sandbox are open (0: none exists)."""
    with _lock:
        entry = _shared.get((os.getpid(), backend))
        return entry[1] if entry else 0
