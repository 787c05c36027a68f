"""Fixtures for the sandbox tests: a docker engine (reachable, or started here), and sandboxes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

from rftgym.envs.code.sandbox import SandboxLimits, make_sandbox

# Small limits keep every hostile case fast.
HOSTILE_LIMITS = SandboxLimits(wall_seconds=4, cpu_seconds=1, memory_mb=128, file_size_mb=2, open_files=32,
                               processes=8, output_bytes=20_000, disk_mb=8)


def unavailable(reason: str):
    """Skip, with the reason printed; CI sets RFTGYM_REQUIRE_SANDBOXES=1 so that a backend it
    installed but cannot use fails the run instead of passing unnoticed."""
    if os.environ.get("RFTGYM_REQUIRE_SANDBOXES") == "1":
        pytest.fail(f"RFTGYM_REQUIRE_SANDBOXES=1 but {reason}", pytrace=False)
    pytest.skip(reason)


# The tests' client waits as long for the engine as a sandbox's own (a dockerd that has just
# started can take seconds to create the first containers); probing for an engine waits 2 s.
CLIENT_TIMEOUT_S = 60.0


def _ping(timeout: float = 2.0):
    import docker
    client = None
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except docker.errors.DockerException:
        if client is not None:
            client.close()
        return None


def _start_dockerd(log_path: str, extra: list[str]) -> subprocess.Popen | None:
    with open(log_path, "ab") as log:  # the daemon keeps its own copy of the descriptor
        proc = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none", *extra], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(120):
        if proc.poll() is not None:
            return None
        probe = _ping()
        if probe is not None:
            probe.close()
            return proc
        time.sleep(0.5)
    proc.terminate()
    proc.wait(30)
    return None


@pytest.fixture(scope="session")
def docker_engine():
    """A docker client: the reachable engine, else a dockerd started here (root only), else skip."""
    pytest.importorskip("docker", reason="the docker SDK is not installed (pip install 'rftgym[docker]')")
    client = _ping(CLIENT_TIMEOUT_S)
    if client is not None:
        yield client
        client.close()
        return
    if shutil.which("dockerd") is None:
        unavailable("no docker engine is reachable and dockerd is not installed (apt-get install docker.io)")
    if os.geteuid() != 0:
        unavailable("no docker engine is reachable and starting dockerd needs root")
    log_path = os.path.join(tempfile.gettempdir(), "rftgym-test-dockerd.log")
    proc = _start_dockerd(log_path, []) or _start_dockerd(log_path, ["--storage-driver", "vfs"])
    if proc is None:
        with open(log_path, "rb") as f:
            tail = f.read()[-800:].decode("utf-8", "replace")
        unavailable(f"no docker engine is reachable and dockerd could not be started here; its log ends:\n{tail}")
    client = _ping(CLIENT_TIMEOUT_S)
    try:
        yield client
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def local_sandbox():
    with make_sandbox("local", limits=HOSTILE_LIMITS, workers=2) as sandbox:
        yield sandbox


@pytest.fixture(scope="session")
def docker_sandbox(docker_engine):
    with make_sandbox("docker", limits=HOSTILE_LIMITS, workers=2, client=docker_engine) as sandbox:
        yield sandbox


@pytest.fixture(scope="session")
def cold_local_sandbox(local_sandbox):
    """The local backend with one jail per run (warm_jails=False)."""
    with make_sandbox("local", limits=local_sandbox.limits, workers=2, warm_jails=False) as sandbox:
        yield sandbox


@pytest.fixture(params=["local", "local-cold", "docker"])
def sandbox(request):
    """Each backend in turn (local: warm jails, and one jail per run), with small limits."""
    name = {"local": "local_sandbox", "local-cold": "cold_local_sandbox", "docker": "docker_sandbox"}
    return request.getfixturevalue(name[request.param])
