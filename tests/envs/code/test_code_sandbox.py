"""The sandbox interface: normal programs, config errors, run_many, backend selection, fallback."""

from __future__ import annotations

import gc
import inspect
import json
import shutil
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest

from rftgym.core.errors import ConfigError, RftgymError
from rftgym.envs.code import sandbox_local
from rftgym.envs.code.sandbox import WORK_DIR, ExecResult, Program, SandboxError, SandboxLimits, make_sandbox

HOSTILE_LIMITS = SandboxLimits(wall_seconds=4, cpu_seconds=1, memory_mb=128, file_size_mb=2, open_files=32,
                               processes=8, output_bytes=20_000, disk_mb=8)


def test_stdout_stdin_and_exit_code(sandbox):
    result = sandbox.run(Program({"main.py": "import sys\nprint(input()[::-1])\nsys.exit(3)"}, stdin="abc\n"))
    assert (result.exit_code, result.signal, result.stdout, result.limit_hit) == (3, None, "cba\n", None)
    assert not result.ok and not result.timed_out and not result.output_truncated


def test_normal_program_is_ok_and_runs_as_nobody(sandbox):
    result = sandbox.run(Program({"main.py": "import os, sys\nprint(os.getuid(), os.getgid(), os.getcwd(), exit)"}))
    assert result.ok, result
    uid, gid, cwd, _ = result.stdout.split(" ", 3)
    assert (uid, gid, cwd) == ("65534", "65534", WORK_DIR)


def test_syntax_error_and_exception_are_results(sandbox):
    syntax = sandbox.run(Program({"main.py": "def f(:\n  pass\n"}))
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr and syntax.limit_hit is None
    raised = sandbox.run(Program({"main.py": "raise ValueError('boom')"}))
    assert raised.exit_code == 1 and "ValueError: boom" in raised.stderr and not raised.ok


def test_python_main_semantics(sandbox):
    source = ("import atexit, sys, threading, time\n"
              "atexit.register(lambda: print('atexit'))\n"
              "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
              "if __name__ == '__main__':\n"
              "    print(sys.argv, __file__, end=' ')\n"
              "    sys.exit('bye')\n")
    result = sandbox.run(Program({"main.py": source}, argv=("python", "main.py", "x")))
    # __file__ is absolute, inside the sandbox's own work dir (its cwd), as CPython gives it.
    assert result.stdout == f"['main.py', 'x'] {WORK_DIR}/main.py thread\natexit\n", result
    assert (result.exit_code, result.stderr) == (1, "bye\n"), result
    interrupted = sandbox.run(Program({"main.py": "raise KeyboardInterrupt"}))
    assert interrupted.signal == 2 and "KeyboardInterrupt" in interrupted.stderr, interrupted


def test_other_commands_run_too(sandbox):
    result = sandbox.run(Program({"main.py": ""}, argv=("python", "-c", "import sys; print(sys.argv[1:])", "a")))
    assert result.ok and result.stdout == "['a']\n", result
    if sandbox.name != "local":
        return   # the docker image holds only Python
    shell = sandbox.run(Program({"data.txt": "hi"}, argv=("sh", "-c", "cat data.txt; exit 4")))
    assert (shell.exit_code, shell.stdout) == (4, "hi"), shell
    missing = sandbox.run(Program({"main.py": ""}, argv=("no-such-command-rftgym",)))
    assert missing.exit_code not in (0, None) and not missing.ok, missing


HASHES = "print(hash('rftgym'), list({'a', 'b', 'c', 'd', 'e'}))"


def _host_output(source: str, seed: int) -> str:
    """What this machine's Python prints for ``source`` under PYTHONHASHSEED=``seed``."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-s", "-c", source], env={"PYTHONHASHSEED": str(seed)},
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("argv", [("python", "main.py"), ("python", "-c", HASHES)], ids=["script", "command"])
def test_every_run_hashes_strings_alike_unless_given_another_seed(sandbox, argv):
    """A program's string hashes (and so a set's order) are the same in every run, whichever
    process or jail runs it: PYTHONHASHSEED is the program's hash_seed, 0 by default."""
    runs = [sandbox.run(Program({"main.py": HASHES}, argv=argv)) for _ in range(3)]
    assert all(r.ok for r in runs), runs
    assert {r.stdout for r in runs} == {_host_output(HASHES, 0)}
    other = sandbox.run(Program({"main.py": HASHES}, argv=argv, hash_seed=1))
    assert other.ok and other.stdout == _host_output(HASHES, 1) != runs[0].stdout, other


@pytest.mark.parametrize("seed", [-1, 2**32, True, "0", 1.0])
def test_a_hash_seed_is_an_int_python_accepts(seed):
    with pytest.raises(ConfigError, match=r"hash_seed must be an int in \[0, 4294967295\] \(PYTHONHASHSEED\)"):
        Program({"main.py": ""}, hash_seed=seed)


def test_multi_file_program_with_argv_and_unicode(sandbox):
    files = {"main.py": "import sys\nfrom pkg.helper import greet\nprint(greet(sys.argv[1]))",
             "pkg/__init__.py": "", "pkg/helper.py": "def greet(n):\n    return 'héllo ' + n + ' ✓'"}
    result = sandbox.run(Program(files, argv=("python", "main.py", "wörld")))
    assert result.ok and result.stdout == "héllo wörld ✓\n", result


def test_large_stdin_is_delivered(sandbox):
    data = "".join(f"{i}\n" for i in range(100_000))
    result = sandbox.run(Program({"main.py": "import sys\nprint(sum(map(int, sys.stdin)))"}, stdin=data))
    assert result.ok and result.stdout == f"{sum(range(100_000))}\n", result


def test_run_many_keeps_order_and_runs_concurrently(sandbox):
    source = "import sys, time, json\nt0 = time.time(); time.sleep(0.4)\nprint(json.dumps([sys.argv[1], t0, time.time()]))"
    programs = [Program({"main.py": source}, argv=("python", "main.py", str(i))) for i in range(4)]
    results = sandbox.run_many(programs)
    spans = [json.loads(r.stdout) for r in results]
    assert [s[0] for s in spans] == ["0", "1", "2", "3"]
    overlapping = max(sum(1 for _, a, b in spans if a <= t < b) for _, t, _ in spans)
    assert overlapping >= 2, f"expected concurrent runs on {sandbox.workers} workers, got {spans}"


def test_per_program_limits_override_the_default(sandbox):
    tight = SandboxLimits(wall_seconds=20, output_bytes=5)
    result = sandbox.run(Program({"main.py": "print('0123456789')"}, limits=tight))
    assert result.output_truncated and result.limit_hit == "output" and len(result.stdout) <= 5


def test_a_run_quiet_for_too_long_is_stopped_before_its_wall_limit(sandbox):
    # A program that reports as it goes, then is stopped (here: it stops itself) and never goes on.
    stopped = "import os, signal, time\nprint('first report', flush=True)\ntime.sleep(0.3)\n" \
              "print('second report', flush=True)\nos.kill(os.getpid(), signal.SIGSTOP)\n"
    limits = SandboxLimits(wall_seconds=30, quiet_seconds=1.5)
    result = sandbox.run(Program({"main.py": stopped}, limits=limits))
    assert result.timed_out and result.limit_hit == "quiet" and result.wall_seconds < 10, result
    assert result.stdout.split() == ["first", "report", "second", "report"]
    # a run that keeps reporting is not stopped, however long it takes in all
    chatty = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.4)\n"
    result = sandbox.run(Program({"main.py": chatty}, limits=limits))
    assert result.ok and result.stdout.split() == [str(i) for i in range(8)], result


def leaked_resources(action) -> list[str]:
    """The ResourceWarnings (unclosed files, sockets, running subprocesses) while ``action`` runs."""
    gc.collect()   # what earlier code left for the collector is not this action's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


def test_runs_close_everything_they_open(sandbox):
    short = replace(sandbox.limits, wall_seconds=1)
    programs = [Program({"main.py": "print(input())"}, stdin="hi\n"),
                Program({"main.py": "import time\ntime.sleep(60)"}, limits=short),
                Program({"main.py": "while True: print('x' * 1000)"})]

    def run_them():
        normal, slow, flood = [sandbox.run(p) for p in programs]
        assert normal.ok and slow.timed_out and flood.output_truncated, (normal, slow, flood)
        assert [r.limit_hit for r in sandbox.run_many(programs)] == [None, "wall", "output"]   # worker threads
    assert leaked_resources(run_them) == []


@pytest.mark.parametrize("warm_jails", [True, False], ids=["warm", "cold"])
def test_making_and_closing_a_local_sandbox_leaks_nothing(warm_jails):
    def make_use_close():
        with make_sandbox("local", limits=HOSTILE_LIMITS, workers=2, warm_jails=warm_jails) as sandbox:
            assert sandbox.run_many([Program({"main.py": "print(1)"})] * 3)[2].stdout == "1\n"
    assert leaked_resources(make_use_close) == []


def test_limits_validation_says_what_is_allowed():
    with pytest.raises(ConfigError, match="memory_mb must be >= 64"):
        SandboxLimits(memory_mb=1)
    with pytest.raises(ConfigError, match="processes must be an int"):
        SandboxLimits(processes=2.5)
    with pytest.raises(ConfigError, match="wall_seconds"):
        SandboxLimits(wall_seconds=float("nan"))
    for quiet in (0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ConfigError, match="quiet_seconds must be None or a finite number >= 0.01"):
            SandboxLimits(quiet_seconds=quiet)
    with pytest.raises(ConfigError, match="relative"):
        Program({"../escape.py": ""})
    with pytest.raises(ConfigError, match="argv"):
        Program({"main.py": ""}, argv="python main.py")


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ConfigError, match="local.*docker.*auto"):
        make_sandbox("podman")
    with pytest.raises(ConfigError, match="workers"):
        make_sandbox("local", workers=0)


def test_ok_property():
    base = dict(signal=None, stdout="", stderr="", timed_out=False, output_truncated=False, wall_seconds=0.1)
    assert ExecResult(exit_code=0, limit_hit=None, **base).ok
    assert not ExecResult(exit_code=0, limit_hit="memory", **base).ok
    assert not ExecResult(exit_code=None, limit_hit=None, **{**base, "signal": 9}).ok


def test_close_is_idempotent_and_a_context_manager():
    with make_sandbox("local", limits=HOSTILE_LIMITS) as sandbox:
        assert sandbox.run(Program({"main.py": "print(1)"})).stdout == "1\n"
    sandbox.close()
    sandbox.close()
    with pytest.raises(SandboxError, match="closed"):
        sandbox.run_many([Program({"main.py": ""})] * 2)


def test_bwrap_is_used_when_installed(local_sandbox):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: the local backend runs in its fallback mode "
                    "(install it: apt-get install bubblewrap)")
    assert local_sandbox.isolation.startswith("bubblewrap"), local_sandbox.isolation
    assert "jail cleaned between runs" in local_sandbox.isolation, "warm jails are the default with bwrap"
    result = local_sandbox.run(Program({"main.py": "import socket\nprint(open('/proc/net/dev').read().count(':'),"
                                                   " socket.gethostname())"}))
    assert result.stdout.split() == ["1", "sandbox"], result   # only the loopback interface


def test_warm_jails_option(cold_local_sandbox):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: warm jails need it")
    assert cold_local_sandbox.isolation.startswith("bubblewrap:"), cold_local_sandbox.isolation
    assert "between runs" not in cold_local_sandbox.isolation
    with pytest.raises(SandboxError, match="warm_jails must be True or False"):
        make_sandbox("local", warm_jails="yes")


def test_use_bwrap_true_without_bwrap_is_a_typed_error(monkeypatch):
    monkeypatch.setattr(sandbox_local.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        make_sandbox("local", use_bwrap=True)


def test_fallback_warns_once_and_still_applies_limits(monkeypatch):
    monkeypatch.setattr(sandbox_local, "_warned_fallback", False)
    with pytest.warns(RuntimeWarning, match="bubblewrap is not in use"):
        sandbox = make_sandbox("local", limits=HOSTILE_LIMITS, use_bwrap=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_sandbox("local", limits=HOSTILE_LIMITS, use_bwrap=False).close()
    assert "NO network or filesystem isolation" in sandbox.isolation
    assert sandbox.run(Program({"main.py": "print(input() * 2)"}, stdin="ab")).stdout == "abab\n"
    assert sandbox.run(Program({"main.py": "x = bytearray(10**9)"})).limit_hit == "memory"
    assert sandbox.run(Program({"main.py": "import time; time.sleep(60)"},
                               limits=SandboxLimits(wall_seconds=0.5))).timed_out
    flood = sandbox.run(Program({"main.py": "while True: print('x' * 1000)"}))
    assert flood.output_truncated and len(flood.stdout) <= HOSTILE_LIMITS.output_bytes
    sandbox.close()


def _fallback_warnings(make) -> list[tuple[str, int]]:
    """Where the fallback warnings that ``make()`` gives point (file, line)."""
    with pytest.warns(RuntimeWarning, match="bubblewrap is not in use") as caught:
        made = make()
    made.close()
    return [(w.filename, w.lineno) for w in caught if "bubblewrap is not in use" in str(w.message)]


def test_the_fallback_warning_names_the_line_that_made_the_sandbox(monkeypatch):
    monkeypatch.setattr(sandbox_local, "_warned_fallback", False)
    line = inspect.currentframe().f_lineno + 1
    where = _fallback_warnings(lambda: make_sandbox("local", limits=HOSTILE_LIMITS, use_bwrap=False))
    assert where == [(__file__, line)]


def test_the_fallback_warning_names_the_line_that_made_the_env(monkeypatch):
    # Through gymnasium.make, the env and the process's shared sandbox: still the user's line.
    gymnasium = pytest.importorskip("gymnasium")
    import rftgym  # noqa: F401 - registers the envs
    from rftgym.envs.code import sandbox_shared

    monkeypatch.setattr(sandbox_shared, "_shared", {})   # a sandbox of its own, not one another test made
    monkeypatch.setattr(sandbox_local, "_warned_fallback", False)
    monkeypatch.setattr(sandbox_local.shutil, "which", lambda name: None)   # no bwrap: the fallback
    line = inspect.currentframe().f_lineno + 1
    where = _fallback_warnings(lambda: gymnasium.make("rftgym/CodeTCG-v0"))
    assert where == [(__file__, line)]


def test_the_docker_backend_tells_an_engine_without_seccomp():
    from rftgym.envs.code.sandbox_docker import engine_seccomp

    assert engine_seccomp({"SecurityOptions": ["name=apparmor", "name=seccomp,profile=builtin", "name=cgroupns"]})
    assert engine_seccomp({"SecurityOptions": ["name=seccomp,profile=/etc/docker/seccomp.json"]})
    assert not engine_seccomp({"SecurityOptions": ["name=seccomp,profile=unconfined"]})
    assert not engine_seccomp({"SecurityOptions": ["name=apparmor"]}) and not engine_seccomp({})


# A ctypes whose prctl fails, in front of the real one: what the docker bootstrap sees where it cannot
# make itself non-dumpable.
FAILING_CTYPES = """
class CDLL:
    def __init__(self, *args, **kwargs):
        pass
    def prctl(self, *args):
        return -1
def get_errno():
    return 1
"""


def test_the_docker_bootstrap_does_not_run_the_program_while_dumpable(tmp_path):
    from rftgym.envs.code.sandbox_docker import BOOTSTRAP

    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "ctypes.py").write_text(FAILING_CTYPES)
    header = json.dumps({"files": {}, "argv": [sys.executable, "-c", "print('the program ran')"]}).encode()
    done = subprocess.run([sys.executable, "-c", BOOTSTRAP], input=b"%d\n" % len(header) + header,
                          capture_output=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "fake")}, timeout=30)
    assert done.returncode == 125 and done.stdout == b"", done
    assert b"could not make itself non-dumpable" in done.stderr and b"not running it" in done.stderr, done


def test_docker_engine_gone_is_a_typed_error():
    pytest.importorskip("docker")
    with pytest.raises(SandboxError, match="start the docker engine") as caught:
        make_sandbox("docker", base_url="unix:///nonexistent/rftgym-docker.sock")
    assert isinstance(caught.value, RftgymError)


class _SlowEngine:
    """A docker client whose engine answers its ping but times out creating a container (the
    SDK lets its transport's errors through, not as DockerException)."""

    def __init__(self):
        import requests

        self.timeout = requests.exceptions.ReadTimeout("Read timed out. (read timeout=2.0)")
        self.containers = self

    def ping(self):
        return True

    def info(self):
        return {"SecurityOptions": ["name=seccomp,profile=builtin"]}

    def create(self, *args, **kwargs):
        raise self.timeout


def test_a_docker_engine_that_times_out_is_a_typed_error():
    pytest.importorskip("docker")
    from rftgym.envs.code.sandbox_docker import DockerSandbox

    sandbox = DockerSandbox(client=_SlowEngine(), image="rftgym-test-image")
    with pytest.raises(SandboxError, match=r"could not create a sandbox container \(Read timed out.*start the docker"):
        sandbox.run(Program({"main.py": "print(1)"}))


def test_auto_picks_a_backend(docker_engine):
    with make_sandbox("auto", limits=HOSTILE_LIMITS) as sandbox:
        assert sandbox.name == "docker"
        assert sandbox.run(Program({"main.py": "print(2 + 2)"})).stdout == "4\n"
