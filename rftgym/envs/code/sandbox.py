"""Run untrusted, model-written programs: limits, programs, results, and the backend factory.

A :class:`Sandbox` runs a :class:`Program` (files written into a fresh private work dir, an argv,
stdin) under :class:`SandboxLimits` and returns an :class:`ExecResult`. A hostile or broken
program is never an exception, only a result (``limit_hit`` says which limit it ran into);
broken infrastructure (no docker engine, bwrap unusable on purpose) raises :class:`SandboxError`.

Backends (``make_sandbox(backend)``):

- ``"local"`` (default, :mod:`.sandbox_local`): with bubblewrap, one jail per worker (no network,
  a read-only system, private tmpfs work dir and /tmp, fresh /proc, its own pid namespace, uid
  65534) whose zygote forks a fresh process per run, in mount, IPC and network namespaces of its
  own (fresh tmpfs's) and with the pid counter set back, so that nothing one run did is seen by
  the next; the jail is cleaned between runs and replaced on anything unusual (:mod:`.sandbox_warm`). ``warm_jails=False``: a fresh jail per run.
  Without bubblewrap, a fallback with rlimits only. rlimits in every mode.
- ``"docker"`` (:mod:`.sandbox_docker`): one container per run from a locally built image.
- ``"auto"``: docker if an engine is reachable, else local.

``argv[0] == "python"`` (or ``"python3"``) means the sandbox's own Python 3 (this interpreter's
base installation, started with ``-s``: no user site; only the standard library is guaranteed).
Every backend clears the environment and sets ``PYTHONHASHSEED`` to the program's ``hash_seed``
(0 unless it says otherwise): an output that depends on string hashing (a set's order) is then
the same in every run, warm jail or fresh, and a grade never depends on which process ran it. The
test-case generator runs its reference a second time under another seed to drop such outputs.
"""

from __future__ import annotations

import os
import signal as signals
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Mapping, Sequence

from ...core.errors import ConfigError, RftgymError

BACKENDS = ("local", "docker", "auto")
PYTHON_NAMES = ("python", "python3")
WORK_DIR = "/work"   # the program's cwd inside a jail
DEFAULT_HASH_SEED = 0   # PYTHONHASHSEED of a program that names none (and of the warm jails' zygotes)
MAX_HASH_SEED = 4294967295   # the largest PYTHONHASHSEED Python accepts


def python_command(python: str, args: Sequence[str]) -> list[str]:
    """The sandbox's own Python running ``args``: no user site (``-s``). Not ``-E``: the backends
    clear the environment themselves, and ``PYTHONHASHSEED`` must take effect."""
    return [python, "-s", *args]


def python_environment(hash_seed: int) -> dict[str, str]:
    """What every backend adds to a program's (otherwise cleared) environment for Python: its hash
    seed, and one malloc arena (each thread's own arena reserves 64 MB of address space, which
    RLIMIT_AS counts against the program's memory limit)."""
    return {"PYTHONHASHSEED": str(hash_seed), "MALLOC_ARENA_MAX": "1"}


class SandboxError(RftgymError, RuntimeError):
    """The sandbox infrastructure failed (not the program); the message says what to do."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. ``disk_mb`` caps each writable tmpfs (the work dir and /tmp) in a jail.
    ``quiet_seconds``: the run is stopped once it has written nothing to stdout or stderr for this
    long (None: no such limit), for a program that reports as it goes, so that one stuck (or
    stopped) between its reports costs that long rather than the whole wall limit."""

    wall_seconds: float = 10.0
    cpu_seconds: float = 10.0
    memory_mb: int = 512
    file_size_mb: int = 16      # max size of any file written
    open_files: int = 64
    processes: int = 32
    output_bytes: int = 1_000_000   # stdout and stderr each capped; the program is then stopped
    disk_mb: int = 64
    quiet_seconds: float | None = None

    def __post_init__(self):
        minimum = {"wall_seconds": 0.01, "cpu_seconds": 0.01, "memory_mb": 64, "file_size_mb": 1,
                   "open_files": 16, "processes": 1, "output_bytes": 1, "disk_mb": 1}
        quiet = self.quiet_seconds
        if quiet is not None and (isinstance(quiet, bool) or not isinstance(quiet, (int, float))
                                  or not 0.01 <= quiet < float("inf")):
            raise ConfigError(f"SandboxLimits.quiet_seconds must be None or a finite number >= 0.01, got {quiet!r}")
        for field in fields(self):
            if field.name == "quiet_seconds":
                continue
            value = getattr(self, field.name)
            number = field.type == "float"
            allowed = (int, float) if number else int
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ConfigError(f"SandboxLimits.{field.name} must be {'a number' if number else 'an int'}, "
                                  f"got {value!r}")
            if not value >= minimum[field.name]:   # also rejects NaN
                raise ConfigError(f"SandboxLimits.{field.name} must be >= {minimum[field.name]}, got {value!r}")
        if self.wall_seconds == float("inf") or self.cpu_seconds == float("inf"):
            raise ConfigError("SandboxLimits.wall_seconds and cpu_seconds must be finite")


@dataclass(frozen=True)
class Program:
    """Files (relative path -> text) written into a fresh work dir, the argv run there, stdin."""

    files: Mapping[str, str]
    argv: Sequence[str] = ("python", "main.py")
    stdin: str = ""
    limits: SandboxLimits | None = None
    hash_seed: int = DEFAULT_HASH_SEED  # PYTHONHASHSEED of the program's Python

    def __post_init__(self):
        if not isinstance(self.files, Mapping):
            raise ConfigError(f"Program.files must map relative paths to text, got {type(self.files).__name__}")
        for path, text in self.files.items():
            check_relative_path(path)
            if not isinstance(text, str):
                raise ConfigError(f"Program.files[{path!r}] must be str, got {type(text).__name__}")
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"Program.argv must be a non-empty sequence of str, got {self.argv!r}")
        if any("\0" in a for a in self.argv):
            raise ConfigError("Program.argv must not contain NUL characters")
        if not isinstance(self.stdin, str):
            raise ConfigError(f"Program.stdin must be str, got {type(self.stdin).__name__}")
        if self.limits is not None and not isinstance(self.limits, SandboxLimits):
            raise ConfigError(f"Program.limits must be a SandboxLimits or None, got {self.limits!r}")
        if type(self.hash_seed) is not int or not 0 <= self.hash_seed <= MAX_HASH_SEED:
            raise ConfigError(f"Program.hash_seed must be an int in [0, {MAX_HASH_SEED}] (PYTHONHASHSEED), "
                              f"got {self.hash_seed!r}")


def check_relative_path(path) -> None:
    if not isinstance(path, str) or not path or "\0" in path:
        raise ConfigError(f"a Program file path must be a non-empty str, got {path!r}")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"a Program file path must be relative and plain (no '', '.', '..' parts), got {path!r}")


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None        # None when killed by a signal
    signal: int | None
    stdout: str
    stderr: str
    timed_out: bool              # a time limit hit: the wall clock, or quiet_seconds
    output_truncated: bool
    wall_seconds: float
    limit_hit: str | None        # "wall" | "quiet" | "cpu" | "memory" | "output" | "file_size" | None, best effort

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit_hit is None and not self.timed_out and not self.output_truncated


MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "cannot allocate memory", "out of memory")
FILE_SIZE_MARKERS = ("File too large", "No space left on device")


def next_time_limit(limits: SandboxLimits, started: float, last_output: float) -> tuple[float, str]:
    """When the run's next time limit falls (``time.monotonic()`` seconds) and which it is:
    "wall", or "quiet" when the run will have written nothing for ``limits.quiet_seconds``."""
    wall = (started + limits.wall_seconds, "wall")
    if limits.quiet_seconds is None:
        return wall
    return min(wall, (last_output + limits.quiet_seconds, "quiet"))


def make_result(*, returncode: int | None, term_signal: int | None, stdout: bytes, stderr: bytes,
                timed_out: bool | str, truncated: bool, wall: float, oom_killed: bool = False) -> ExecResult:
    """The result of a finished run, with a best-effort guess of which limit stopped it
    (``timed_out``: the time limit that did, "wall" or "quiet", or True for the wall)."""
    err = stderr.decode("utf-8", "replace")
    if timed_out:
        limit = timed_out if isinstance(timed_out, str) else "wall"
    elif truncated:
        limit = "output"
    elif term_signal == signals.SIGXCPU:
        limit = "cpu"
    elif term_signal == signals.SIGXFSZ:
        limit = "file_size"
    elif oom_killed or (returncode != 0 and any(m in err for m in MEMORY_MARKERS)):
        limit = "memory"
    elif returncode != 0 and any(m in err for m in FILE_SIZE_MARKERS):
        limit = "file_size"
    else:
        limit = None
    return ExecResult(exit_code=None if term_signal is not None else returncode, signal=term_signal,
                      stdout=stdout.decode("utf-8", "replace"), stderr=err, timed_out=bool(timed_out),
                      output_truncated=truncated, wall_seconds=wall, limit_hit=limit)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class Sandbox(ABC):
    """Runs programs; ``run_many`` runs them concurrently on ``workers`` threads, in input order."""

    name: str = "abstract"
    isolation: str = ""
    # Whether programs are kept from the network and the host's files (False: rlimits only).
    isolated: bool = True

    def __init__(self, *, limits: SandboxLimits | None = None, workers: int | None = None):
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise ConfigError(f"limits must be a SandboxLimits or None, got {limits!r}")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"workers must be a positive int or None (= the number of cores), got {workers!r}")
        self.limits = limits or SandboxLimits()
        self.workers = workers or default_workers()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._closed = False

    def limits_for(self, program: Program) -> SandboxLimits:
        return program.limits or self.limits

    @abstractmethod
    def run(self, program: Program) -> ExecResult:
        """Run one program to completion (or to a limit)."""

    def run_many(self, programs: Sequence[Program]) -> list[ExecResult]:
        programs = list(programs)
        if len(programs) <= 1 or self.workers == 1:
            return [self.run(p) for p in programs]
        if self._closed:
            raise SandboxError(f"this {self.name} sandbox is closed; make a new one with make_sandbox()")
        with self._pool_lock:  # envs sharing this sandbox may call in from several threads
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"rftgym-sandbox-{self.name}")
            pool = self._pool
        return list(pool.map(self.run, programs))

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}: {self.isolation}>"


def make_sandbox(backend: str = "local", *, limits: SandboxLimits | None = None, workers: int | None = None,
                 **backend_options) -> Sandbox:
    """A sandbox by backend name: ``"local"`` | ``"docker"`` | ``"auto"`` (docker if reachable)."""
    if backend not in BACKENDS:
        raise ConfigError(f"sandbox backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        from .sandbox_docker import docker_reachable
        backend = "docker" if docker_reachable() else "local"
    if backend == "docker":
        from .sandbox_docker import DockerSandbox
        return DockerSandbox(limits=limits, workers=workers, **backend_options)
    from .sandbox_local import LocalSandbox
    return LocalSandbox(limits=limits, workers=workers, **backend_options)
