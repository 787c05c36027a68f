"""The docker sandbox backend: one container per run, through the ``docker`` SDK.

Each run is a fresh container from the locally built image (:func:`.docker_image.ensure_image`):
no network (``network_mode="none"``), read-only root fs, size- and inode-capped tmpfs work dir,
/tmp and /dev/shm (:func:`.jail_server.inode_cap`: an empty file costs no page), uid/gid 65534,
all capabilities dropped, no-new-privileges, memory (no swap), pids and CPU-quota limits from the
cgroup, rlimits (cpu, address space, file size, open files), no log driver (output never reaches
the engine's disk). The program's files and stdin go in on the attach stream: a tiny bootstrap
writes the files into /work and execs the argv, whose stdin is the rest of the stream. Wall
timeout, output cap and every exit remove the container.

Reaching into other processes: the engine's default seccomp profile (which the sandbox checks is
in force, see :func:`engine_seccomp`) refuses the kernel keyring, ``process_vm_readv``/``writev``
and ``pidfd_getfd``, as the local jail's filter does; it allows ``ptrace`` (and /proc/<pid>/mem),
which the local filter refuses. That reaches only dumpable processes of the same uid, i.e. those
running the program's own code: the bootstrap (pid 1, which holds the attach stream; one that
cannot does not run the program) and the test runner's supervisor make themselves non-dumpable,
and with every capability dropped (no ``CAP_SYS_PTRACE``) and no-new-privileges the kernel
refuses to attach to them, or to read or write their memory or take their fds, whatever the
profile. So no profile of our own is needed. Each run is a new container: no file, pid, IPC
object or packet counter of one run is seen by the next.
"""

from __future__ import annotations

import json
import logging
import select
import signal
import socket
import struct
import time

from ...core.errors import require
from .docker_image import base_python, ensure_image
from .jail_init import RUN_PROGRAM
from .jail_server import inode_cap
from .sandbox import (PYTHON_NAMES, WORK_DIR, ExecResult, Program, Sandbox, SandboxError, SandboxLimits, make_result,
                      next_time_limit, python_command, python_environment)

log = logging.getLogger(__name__)
MB = 1 << 20
ENGINE_HINT = ("start the docker engine (e.g. `dockerd &`, or `systemctl start docker`), check `docker info`, "
               "or use the local backend: make_sandbox('local') (on the command line: --env-arg sandbox=local)")
# Reads a length-prefixed JSON header from stdin (files, argv), writes the files, runs the argv as
# .jail_init.RUN_PROGRAM does (as a cold local jail's init does); the program's stdin is the rest
# of the stream (read byte-exact so that nothing is consumed).
BOOTSTRAP = RUN_PROGRAM + r"""
import json, os
def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            break
        data += chunk
    return data
size = b""
while not size.endswith(b"\n"):
    c = os.read(0, 1)
    if not c:
        raise SystemExit("sandbox bootstrap: no header on stdin")
    size += c
spec = json.loads(read(int(size)))
for path, text in spec["files"].items():
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
# Stay pid 1 (which ignores default-action signals such as SIGXCPU) and run the program as a child.
# Not dumpable, so that the program (same uid) can neither ptrace this process, which holds the
# attach stream's stdout, nor write code into it through /proc/1/mem, to write there past the test
# runner (the program's own copy is reset by exec, so nothing it does changes). Where that fails
# the program does not run.
try:
    import ctypes
    failed = ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0   # PR_SET_DUMPABLE, 0
    why = os.strerror(ctypes.get_errno())
except (ImportError, OSError, AttributeError) as e:
    failed, why = True, repr(e)
if failed:
    os.write(2, ("sandbox bootstrap: could not make itself non-dumpable (%s), so the program could write "
                 "past the test runner: not running it\n" % why).encode())
    os._exit(125)
child = os.fork()
if child == 0:
    exec_program(spec["argv"])
exit_as(child)
"""


def engine_seccomp(info: dict) -> bool:
    """Whether an engine (its ``docker info``) confines containers with a seccomp profile: its
    default one unless the daemon was told otherwise (``--seccomp-profile unconfined``), or none
    where the kernel has no seccomp."""
    for option in info.get("SecurityOptions") or []:
        fields = dict(part.split("=", 1) for part in str(option).split(",") if "=" in part)
        if fields.get("name") == "seccomp":
            return fields.get("profile") != "unconfined"
    return False


def docker_reachable(timeout: float = 2.0) -> bool:
    """Whether the docker SDK is installed and an engine answers a ping."""
    try:
        import docker
        client = docker.from_env(timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:   # no SDK, no socket, no permission: all mean "not reachable"
        return False


class DockerSandbox(Sandbox):
    """Runs each program in a fresh, network-less, read-only container."""

    name = "docker"

    def __init__(self, *, limits: SandboxLimits | None = None, workers: int | None = None,
                 image: str | None = None, cpus: float = 1.0, client=None, base_url: str | None = None):
        super().__init__(limits=limits, workers=workers)
        docker = require("docker", "docker", "The docker sandbox backend")
        import requests  # the docker SDK's transport (a dependency of it)

        self._errors = docker.errors
        # What the engine's failures can raise: the SDK's own errors, and its transport's, which it
        # lets through (a read timeout of an engine that is slow to answer, a connection refused).
        self._engine_errors = (docker.errors.DockerException, requests.exceptions.RequestException)
        self._ulimit = docker.types.Ulimit
        self._own_client = client is None
        self.client = None
        try:
            if client is None:
                client = docker.DockerClient(base_url=base_url, timeout=60) if base_url else docker.from_env(timeout=60)
            self.client = client
            self.client.ping()
            self.seccomp = engine_seccomp(self.client.info())
        except self._engine_errors as exc:
            self.close()   # a client made here would otherwise leave its connection pool open
            raise SandboxError(f"no docker engine is reachable ({exc}); {ENGINE_HINT}") from exc
        try:
            self.image = image or ensure_image(self.client)
        except BaseException:
            self.close()
            raise
        self.python = base_python().executable
        self.cpus = cpus
        profile = "the engine's seccomp profile" if self.seccomp else "NO seccomp profile"
        self.isolation = (f"docker ({self.image}): network none, read-only root, tmpfs /work and /tmp, uid 65534, "
                          f"no capabilities, {profile}, memory/pids/cpu cgroup limits, rlimits")
        if not self.seccomp:
            log.warning("rftgym docker sandbox: the docker engine runs containers without a seccomp profile; runs "
                        "can reach the kernel keyring (kept per uid, across containers). Start dockerd without "
                        "--seccomp-profile=unconfined, or use the local backend")

    def close(self) -> None:
        super().close()
        if self._own_client and self.client is not None:
            self.client.close()
        self.client = None

    def run(self, program: Program) -> ExecResult:
        if self.client is None:
            raise SandboxError("this docker sandbox is closed; make a new one with make_sandbox('docker')")
        limits = self.limits_for(program)
        argv = list(program.argv)
        if argv[0] in PYTHON_NAMES:
            argv = python_command(self.python, argv[1:])
        header = json.dumps({"files": dict(program.files), "argv": argv}).encode()
        payload = b"%d\n" % len(header) + header + program.stdin.encode()
        try:
            container = self.client.containers.create(self.image, **self._container_options(limits, program.hash_seed))
        except self._engine_errors as exc:
            raise SandboxError(f"docker could not create a sandbox container ({exc}); {ENGINE_HINT}") from exc
        try:
            return self._run_in(container, payload, limits)
        except (*self._engine_errors, OSError) as exc:
            raise SandboxError(f"the docker engine failed during a sandbox run ({exc}); {ENGINE_HINT}") from exc
        finally:
            try:
                container.remove(force=True)
            except self._engine_errors:
                pass

    def _container_options(self, limits: SandboxLimits, hash_seed: int) -> dict:
        size = limits.disk_mb * MB
        # A tmpfs entry for /dev/shm replaces the engine's own (shm_size), which takes no nr_inodes.
        disk = f"size={size},nr_inodes={inode_cap(size)},mode=1777"
        cpu = max(1, int(limits.cpu_seconds + 0.999))
        Ulimit = self._ulimit
        return dict(
            command=python_command(self.python, ["-c", BOOTSTRAP]), user="65534:65534", working_dir=WORK_DIR,
            stdin_open=True, detach=False, tty=False,   # detach=False: StdinOnce
            network_mode="none", read_only=True,
            tmpfs={WORK_DIR: disk, "/tmp": disk, "/dev/shm": disk},
            mem_limit=limits.memory_mb * MB, memswap_limit=limits.memory_mb * MB,
            pids_limit=limits.processes + 1,   # + the bootstrap (pid 1)
            nano_cpus=int(self.cpus * 1e9),
            cap_drop=["ALL"], security_opt=["no-new-privileges"], log_config={"type": "none"},
            environment={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "TMPDIR": "/tmp",
                         "LANG": "C.UTF-8", **python_environment(hash_seed)},
            ulimits=[Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
                     Ulimit(name="fsize", soft=limits.file_size_mb * MB, hard=limits.file_size_mb * MB),
                     Ulimit(name="nofile", soft=limits.open_files, hard=limits.open_files),
                     Ulimit(name="core", soft=0, hard=0)],
        )

    def _run_in(self, container, payload: bytes, limits: SandboxLimits) -> ExecResult:
        stream = self.client.api.attach_socket(container.id, params={"stdin": 1, "stdout": 1, "stderr": 1,
                                                                     "stream": 1})
        sock = getattr(stream, "_sock", stream)
        try:
            started = time.monotonic()
            container.start()
            out, err, timed_out, truncated = pump(sock, payload, limits, started)
        finally:
            sock.close()
            stream.close()
        if timed_out or truncated:
            try:
                container.kill()
            except self._errors.APIError as exc:
                if exc.status_code != 409:  # 409: it exited on its own meanwhile, which is all we wanted
                    raise
        status = container.wait(timeout=max(5.0, limits.wall_seconds))
        wall = time.monotonic() - started
        code = int(status.get("StatusCode", -1))
        container.reload()
        oom = bool(container.attrs.get("State", {}).get("OOMKilled"))
        term = code - 128 if code > 128 and code - 128 in _SIGNALS else None
        if timed_out or truncated:
            term = signal.SIGKILL
        return make_result(returncode=code, term_signal=term, stdout=out, stderr=err, timed_out=timed_out,
                           truncated=truncated, wall=wall, oom_killed=oom)


_SIGNALS = {int(s) for s in signal.Signals}


def pump(sock: socket.socket, payload: bytes, limits: SandboxLimits, started: float):
    """Send ``payload`` (then half-close) while reading the multiplexed stdout/stderr frames of a
    docker attach stream. Returns (stdout, stderr, timed_out, truncated), ``timed_out`` the time
    limit that stopped the run ("wall" or "quiet") or None."""
    sock.setblocking(False)
    pending = memoryview(payload)
    streams = {1: bytearray(), 2: bytearray()}
    raw = bytearray()
    cap = limits.output_bytes
    truncated, timed_out = False, None
    last_output = started
    while True:
        deadline, limit = next_time_limit(limits, started, last_output)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = limit
            break
        readable, writable, _ = select.select([sock], [sock] if pending else [], [], remaining)
        if writable:
            try:
                pending = pending[sock.send(pending[:1 << 16]):]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                pending = memoryview(b"")   # the program is gone; it no longer reads stdin
            if not pending:
                try:
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if readable:
            try:
                chunk = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                break
            if not chunk:
                break
            raw += chunk
            while len(raw) >= 8:   # frame: stream id, 3 zero bytes, big-endian uint32 size
                kind, size = raw[0], struct.unpack(">I", raw[4:8])[0]
                if len(raw) < 8 + size:
                    break
                if kind in streams:
                    streams[kind] += raw[8:8 + size]
                    last_output = time.monotonic()
                del raw[:8 + size]
            if len(streams[1]) > cap or len(streams[2]) > cap:
                truncated = True
                break
    return bytes(streams[1][:cap]), bytes(streams[2][:cap]), timed_out, truncated
