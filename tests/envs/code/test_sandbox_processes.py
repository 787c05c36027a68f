"""Every process the local sandbox starts on the host is reaped by the sandbox itself: none is
left running, and none is left for the host's pid 1 to reap (a zombie there when pid 1 reaps
late, or never, as a container's own program does)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

# Runs in a child process that makes itself a child subreaper (PR_SET_CHILD_SUBREAPER), so that a
# process the sandbox leaves to "pid 1" comes to it instead, where it can be counted.
COUNT_LEFT_BEHIND = textwrap.dedent("""
    import ctypes, json, os, sys
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:
        sys.exit("prctl(PR_SET_CHILD_SUBREAPER) failed")
    from rftgym.envs.code.sandbox import Program, SandboxLimits, make_sandbox

    def children(state=None):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as handle:
                    stat = handle.read()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and state in (None, fields[0]):
                found.append(f"{name} ({fields[0]})")
        return found

    sources = {
        "exits": "print(1)",
        "times out": "import time\\ntime.sleep(60)",
        "forks a bomb": "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass",
        "leaves a daemon": "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(60)\\nprint(2)",
    }
    limits = SandboxLimits(wall_seconds=0.5, cpu_seconds=1, processes=8, memory_mb=128)
    with make_sandbox("local", limits=limits, workers=1, warm_jails=sys.argv[1] == "warm") as sandbox:
        outcomes = {name: sandbox.run(Program({"main.py": source})).limit_hit for name, source in sources.items()}
        zombies = children("Z")   # the warm jail's own bwrap is a child too, while the sandbox is open
    print(json.dumps({"outcomes": outcomes, "zombies": zombies, "after": children()}))
""")


@pytest.mark.parametrize("mode", ["cold", "warm"])
def test_runs_leave_no_process_and_no_zombie_behind(mode):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: the jails need it")
    done = subprocess.run([sys.executable, "-c", COUNT_LEFT_BEHIND, mode], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["outcomes"] == {"exits": None, "times out": "wall", "forks a bomb": "wall",
                                  "leaves a daemon": None}, report
    assert report["zombies"] == [] and report["after"] == [], report
