"""The pid-1 programs (a cold local jail's init, the docker bootstrap) run a program the same way.

Both are plain Python, run here on the host: no bwrap jail or docker container is needed to see
which signals the program starts with ignored, how an exec failure reads and the exit status.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from rftgym.envs.code.sandbox_docker import BOOTSTRAP
from rftgym.envs.code.sandbox_local import COLD_INIT


def run_cold_init(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """COLD_INIT as bwrap starts it, without the inode-capped tmpfs's (empty options)."""
    return subprocess.run([sys.executable, "-I", "-S", "-c", COLD_INIT, "", *argv], capture_output=True,
                          stdin=subprocess.DEVNULL, cwd=cwd, timeout=30)


def run_bootstrap(argv: list[str], cwd) -> subprocess.CompletedProcess:
    """BOOTSTRAP fed the length-prefixed JSON header that DockerSandbox.run sends."""
    header = json.dumps({"files": {"data.txt": "hi"}, "argv": argv}).encode()
    return subprocess.run([sys.executable, "-I", "-S", "-c", BOOTSTRAP], input=b"%d\n" % len(header) + header,
                          capture_output=True, cwd=cwd, timeout=30)


PID1_PROGRAMS = {"cold init": run_cold_init, "docker bootstrap": run_bootstrap}


@pytest.fixture(params=sorted(PID1_PROGRAMS))
def run_pid1(request, tmp_path):
    return lambda argv: PID1_PROGRAMS[request.param](argv, tmp_path)


def ignored_signals(status: str) -> set[int]:
    """The signals a /proc/<pid>/status text says its process ignores."""
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_the_program_starts_with_sigpipe_and_sigxfsz_at_their_default(run_pid1):
    # Not a Python program: Python ignores SIGPIPE and SIGXFSZ itself at start-up.
    done = run_pid1(["grep", "SigIgn", "/proc/self/status"])
    assert done.returncode == 0, done
    ignored = ignored_signals(done.stdout.decode())
    assert not ignored & {signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT}, (ignored, done)


def test_a_pipe_closed_early_ends_its_writer_quietly(run_pid1):
    done = run_pid1(["sh", "-c", "yes | head -n 1"])
    assert (done.returncode, done.stdout, done.stderr) == (0, b"y\n", b""), done


@pytest.mark.parametrize(("source", "code"), [
    ("import sys; sys.exit(3)", 3),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 128 + signal.SIGTERM),
])
def test_the_exit_status_is_the_programs(run_pid1, source, code):
    done = run_pid1([sys.executable, "-I", "-c", source])
    assert (done.returncode, done.stderr) == (code, b""), done


def test_a_program_that_cannot_be_executed_is_reported_the_same_way(run_pid1, tmp_path):
    missing = run_pid1(["no-such-command-rftgym"])
    assert (missing.returncode, missing.stdout, missing.stderr) == (
        127, b"", b"rftgym jail: cannot execute no-such-command-rftgym: No such file or directory\n"), missing
    not_executable = tmp_path / "not-executable"
    not_executable.write_text("#!/bin/sh\n")
    refused = run_pid1([str(not_executable)])
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        126, b"", f"rftgym jail: cannot execute {not_executable}: Permission denied\n".encode()), refused
