"""The local sandbox run by a non-root user. The jail's uid then maps to the host user who made
the output pipes, so those pipes are the jail's to reopen through /proc/<pid>/fd of any process
of the jail that holds them and is dumpable (a cold jail's init did): a program could write the
test runner's records itself. As root (CI) the test drops to uid 65534 in a subprocess first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest

import rftgym
from rftgym.envs.code.docker_image import base_python, readable_by_others, runtime_tree

NON_ROOT = 65534

# Every fd of every other process of the jail that can be reopened for writing gets a line; the
# program first points its own stdout and stderr at /dev/null, so that only a reopened pipe can
# carry such a line to the host. It reports the paths it opened on its own copy of stdout.
SCAN_OTHER_PROCESSES = textwrap.dedent("""
    import json, os
    report = os.dup(1)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    opened = []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = [str(n) for n in range(10)]
        for fd in fds:
            try:
                handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            opened.append(f"/proc/{pid}/fd/{fd}")
            try:
                os.write(handle, f"FORGED through /proc/{pid}/fd/{fd}\\n".encode())
            except OSError:
                pass
            os.close(handle)
    os.write(report, (json.dumps(opened) + "\\n").encode())
""")

# The same, as a graded candidate in the test runner (its supervisor holds the host's stdout):
# the count of other processes' fds it could open for writing, 0 in a sound jail.
CANDIDATE = textwrap.dedent("""
    import os
    def reachable(x):
        found = 0
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
            for fd in range(10):
                try:
                    os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK))
                    found += 1
                except OSError:
                    pass
        return found
""")

CHILD = textwrap.dedent("""
    import json, os, sys
    try:
        from rftgym.envs.code.codec import encode
        from rftgym.envs.code.harness import grade
        from rftgym.envs.code.sandbox import Program, SandboxError, SandboxLimits
        from rftgym.envs.code.sandbox_local import LocalSandbox
        from rftgym.envs.code.tasks import CodeTask, TestCase
    except ImportError as exc:
        print(json.dumps({"cannot": f"rftgym or its packages cannot be imported as uid {os.getuid()}: {exc}"}))
        sys.exit(0)
    scan, candidate, mode = sys.argv[1:4]
    limits = SandboxLimits(wall_seconds=10, cpu_seconds=5, memory_mb=256, processes=16, disk_mb=8)
    try:
        sandbox = LocalSandbox(limits=limits, workers=1, use_bwrap=True, warm_jails=mode == "warm")
    except SandboxError as exc:
        print(json.dumps({"cannot": f"bubblewrap does not work for uid {os.getuid()} here: {exc}"}))
        sys.exit(0)
    task = CodeTask(task_id="reach", source="test", style="function", prompt="", entry_point="reachable",
                    reference="def reachable(x):\\n    return 0\\n",
                    tests=tuple(TestCase(input=f"({x},)", expected=encode(0)) for x in (1, 2)))
    try:
        raw = sandbox.run(Program({"main.py": scan}))
        graded = grade(task, candidate, sandbox, per_test_seconds=5.0)
    finally:
        sandbox.close()
    print(json.dumps({"uid": os.getuid(), "warm": sandbox.warm, "stdout": raw.stdout, "stderr": raw.stderr,
                      "exit": raw.exit_code, "passed": graded.passed, "total": graded.total,
                      "got": [r.got for r in graded.results], "errors": [r.error for r in graded.results]}))
""")


def _as_non_root() -> tuple[list[str], dict, dict]:
    """The command prefix, environment and Popen options that run Python as a non-root user
    who can import this checkout (root's own interpreter may be unreadable to others)."""
    paths = [os.path.dirname(os.path.dirname(rftgym.__file__)), sysconfig.get_paths()["purelib"]]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": os.pathsep.join(paths)}
    if os.geteuid() != 0:
        return [sys.executable], env, {}
    runtime = base_python()
    tree = "" if readable_by_others(runtime.executable) else runtime_tree()
    if tree:
        env["LD_LIBRARY_PATH"] = tree + (runtime.libdir or "")
    return [tree + runtime.executable], env, {"user": NON_ROOT, "group": NON_ROOT, "extra_groups": []}


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_no_process_of_the_jail_lets_a_non_root_hosts_pipes_be_reopened(mode):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: the jails need it")
    python, env, drop = _as_non_root()
    done = subprocess.run([*python, "-c", CHILD, SCAN_OTHER_PROCESSES, CANDIDATE, mode], capture_output=True,
                          text=True, env=env, cwd="/", stdin=subprocess.DEVNULL, timeout=180, **drop)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    if "cannot" in report:
        pytest.skip(f"the sandbox cannot be run as a non-root user here: {report['cannot']}")
    assert report["uid"] != 0 and report["warm"] == (mode == "warm"), report
    assert report["exit"] == 0 and json.loads(report["stdout"].splitlines()[-1]) == [], report
    assert "FORGED" not in report["stdout"] + report["stderr"], report
    assert (report["passed"], report["total"]) == (2, 2), report   # each test: 0 fds reachable
