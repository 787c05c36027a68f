"""Hostile programs, on every backend: each is contained, the host is unchanged, and the same
sandbox then runs a normal program correctly. Then the warm jails' own promise: nothing a run
does reaches a later run in the same jail, and a jail that may be dirty is replaced."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace

import pytest

from rftgym.envs.code import sandbox_local, sandbox_warm
from rftgym.envs.code.sandbox import Program, SandboxError, SandboxLimits, make_sandbox


def run(sandbox, source: str, wall: float | None = None):
    limits = replace(sandbox.limits, wall_seconds=wall) if wall else None
    result = sandbox.run(Program({"main.py": source}, limits=limits))
    healthy = sandbox.run(Program({"main.py": "print(sum(range(int(input()))))"}, stdin="10\n"))
    assert healthy.ok and healthy.stdout == "45\n", f"sandbox broken after a hostile run: {healthy}"
    return result


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline or marker.encode() in environ:
            found.append(int(pid))
    return found


FORK_BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

# Forks sleeping children until fork fails; prints how many it started.
COUNT_FORKS = """
import os, time
started = 0
for _ in range(50):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        started += 1
    except OSError:
        break
print(started)
"""


def test_fork_bomb(sandbox):
    result = run(sandbox, FORK_BOMB, wall=2)
    assert not result.ok and result.limit_hit in ("cpu", "wall"), result


def test_process_limit_bites(sandbox):
    source = COUNT_FORKS
    result = run(sandbox, source)
    assert result.exit_code == 0 and 0 < int(result.stdout) < sandbox.limits.processes, result


def test_memory_bomb(sandbox):
    result = run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))")
    assert result.limit_hit == "memory" and not result.ok, result


def test_infinite_loop_hits_cpu_or_wall(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.limit_hit in ("cpu", "wall") and not result.ok, result


def test_sleep_forever_hits_wall(sandbox):
    result = run(sandbox, "import time\ntime.sleep(3600)", wall=1)
    assert result.timed_out and result.limit_hit == "wall" and result.exit_code is None, result


@pytest.mark.parametrize("source", [
    "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)",
    "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
    "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
    "i = 0\nwhile True:\n    open(f'/dev/shm/f{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
], ids=["one-file", "workdir", "tmp", "shm"])
def test_disk_filler(sandbox, source):
    result = run(sandbox, source)
    assert result.limit_hit == "file_size" and not result.ok, result


# Makes empty files in each writable tmpfs until the kernel refuses one (or 20,000 are made).
EMPTY_FILES = """
import json, os
made = {}
for root in ("/work", "/tmp", "/dev/shm"):
    n, error = 0, None
    try:
        while n < 20000:
            os.close(os.open(f"{root}/empty{n}", os.O_CREAT | os.O_WRONLY, 0o600))
            n += 1
    except OSError as exc:
        error = exc.errno
    made[root] = (n, error)
print(json.dumps(made))
"""


def test_empty_files_past_the_inode_cap_fail_cleanly(sandbox):
    # An empty file takes no page of a tmpfs's size, but its inode is kernel memory: each tmpfs
    # holds one inode per page of its size, on every backend.
    assert_inodes_capped(sandbox)


def assert_inodes_capped(sandbox) -> None:
    result = run(sandbox, EMPTY_FILES)
    assert result.ok, result
    pages = sandbox.limits.disk_mb * (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    backend = "local (cold)" if sandbox.name == "local" and not sandbox.warm else sandbox.name
    for root, (made, error) in json.loads(result.stdout).items():
        assert error == errno.ENOSPC and pages // 2 < made <= pages, (backend, root, made, error)


def capped_cold_runs(monkeypatch, time_out_first: int = 0) -> list[str]:
    """Record each cold run whose init holds capabilities (the inode cap's, probes included) as
    "ran" or, for the first ``time_out_first`` of them, "timed out": those report a wall timeout
    whatever they did, as on a host too loaded for the probe's time limit."""
    drive = sandbox_local.drive
    capped: list[str] = []

    def drive_timing_out(proc, *args):
        outcome = drive(proc, *args)
        if "--cap-add" not in proc.args:
            return outcome
        capped.append("timed out" if len(capped) < time_out_first else "ran")
        return (b"", b"", "wall", False) if capped[-1] == "timed out" else outcome
    monkeypatch.setattr(sandbox_local, "drive", drive_timing_out)
    return capped


def uncapped_cold_sandbox(limits, caplog):
    """A cold local sandbox that is expected to run without the inode cap; its warnings."""
    with caplog.at_level("WARNING", logger=sandbox_local.__name__):
        sandbox = make_sandbox("local", limits=limits, workers=1, warm_jails=False)
    assert sandbox.bwrap_base and not sandbox.cold_inode_cap and sandbox.seccomp, sandbox.isolation
    assert "private tmpfs /work and /tmp (NO inode cap)" in sandbox.isolation, sandbox.isolation
    assert "keep the kernel's default inode limit" in caplog.text, caplog.text
    return sandbox, caplog.text


def test_a_cold_jail_whose_bwrap_refuses_capabilities_runs_without_the_inode_cap(local_sandbox, monkeypatch,
                                                                                  caplog):
    """A setuid bwrap refuses --cap-add: a cold jail without the cap rather than no jail, and a
    warning that quotes bwrap's refusal (here of a capability it does not know)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: cold jails need it")
    monkeypatch.setattr(sandbox_local, "COLD_CAPABILITIES", ("CAP_NOT_A_CAPABILITY",))
    capped = capped_cold_runs(monkeypatch)
    sandbox, warned = uncapped_cold_sandbox(local_sandbox.limits, caplog)
    with sandbox:
        result = run(sandbox, "print(sorted({int(line.split()[1], 16) for line in open('/proc/self/status') "
                              "if line.startswith('Cap')}))")
    assert result.ok and result.stdout == "[0]\n", result
    assert "(exit 1: bwrap: unknown cap: CAP_NOT_A_CAPABILITY)" in warned, warned
    assert capped == ["ran"], capped   # a refusal is final: the later runs do not probe again


def test_a_cold_inode_cap_probe_that_timed_out_is_tried_again_at_the_next_run(local_sandbox, monkeypatch, caplog):
    """A probe that timed out says nothing about the cap: the next cold run probes again, and
    with that probe passing, it and every later run are capped."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: cold jails need it")
    capped = capped_cold_runs(monkeypatch, time_out_first=1)
    sandbox, warned = uncapped_cold_sandbox(local_sandbox.limits, caplog)
    assert "timed out after" in warned and "too loaded" in warned, warned
    with sandbox:
        assert_inodes_capped(sandbox)
        assert sandbox.cold_inode_cap and "(NO inode cap)" not in sandbox.isolation, sandbox.isolation
    # The probe at start-up, its retry at the first run, then that run and the healthy one after it.
    assert capped == ["timed out", "ran", "ran", "ran"], capped


def test_a_cold_inode_cap_probe_that_keeps_timing_out_is_retried_a_bounded_number_of_times(local_sandbox,
                                                                                           monkeypatch, caplog):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: cold jails need it")
    capped = capped_cold_runs(monkeypatch, time_out_first=100)
    with caplog.at_level("INFO", logger=sandbox_local.__name__):
        with make_sandbox("local", limits=local_sandbox.limits, workers=1, warm_jails=False) as sandbox:
            for _ in range(sandbox_local.COLD_CAP_PROBES + 2):
                assert sandbox.run(Program({"main.py": "print('ran')"})).stdout == "ran\n"
            assert not sandbox.cold_inode_cap and "(NO inode cap)" in sandbox.isolation, sandbox.isolation
    assert capped == ["timed out"] * sandbox_local.COLD_CAP_PROBES, capped
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "keep the kernel's default inode limit" in warned[0], warned
    assert "the inode cap's last probe failed too (timed out after" in caplog.text, caplog.text


def test_a_refusal_of_the_inode_cap_after_a_timed_out_probe_is_warned_with_its_cause(local_sandbox, monkeypatch,
                                                                                     caplog):
    """The first probe timed out (its warning blames the load); the retry's refusal is what to fix,
    so it is warned too, quoting bwrap, and no probe follows."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: cold jails need it")
    monkeypatch.setattr(sandbox_local, "COLD_CAPABILITIES", ("CAP_NOT_A_CAPABILITY",))
    capped = capped_cold_runs(monkeypatch, time_out_first=1)
    with caplog.at_level("WARNING", logger=sandbox_local.__name__):
        with make_sandbox("local", limits=local_sandbox.limits, workers=1, warm_jails=False) as sandbox:
            for _ in range(3):
                assert sandbox.run(Program({"main.py": "print('ran')"})).stdout == "ran\n"
            assert not sandbox.cold_inode_cap and "(NO inode cap)" in sandbox.isolation, sandbox.isolation
    assert capped == ["timed out", "ran"], capped  # ("ran": bwrap was started, and refused the capability)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "timed out" in warned[0] and "unknown cap: CAP_NOT_A_CAPABILITY" in warned[1], warned


def test_a_cold_jail_whose_capped_tmpfs_cannot_be_mounted_runs_without_the_inode_cap(local_sandbox, monkeypatch,
                                                                                     caplog):
    """The init's own failure (here the kernel refusing its tmpfs options, as a security module
    refusing the mount would): a cold jail without the cap, and a warning that says what failed."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: cold jails need it")
    monkeypatch.setattr(sandbox_local, "inode_cap", lambda size: "not-a-number")
    sandbox, warned = uncapped_cold_sandbox(local_sandbox.limits, caplog)
    with sandbox:
        assert run(sandbox, "print('ran')").stdout == "ran\n"
    assert ("(exit 126: rftgym jail: could not set up the inode-capped tmpfs's, not running the program: "
            "[Errno 22] could not mount a tmpfs on /tmp: Invalid argument)") in warned, warned


def test_a_broken_bwrap_costs_two_probes_at_most(monkeypatch, tmp_path):
    """One with the seccomp filter, one without; none for the cold init's inode cap."""
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: broken here' >&2\nexit 1\n")
    broken.chmod(0o755)
    which = shutil.which
    monkeypatch.setattr(sandbox_local.shutil, "which", lambda name: str(broken) if name == "bwrap" else which(name))
    monkeypatch.setattr(sandbox_local, "_warned_fallback", True)   # the fallback's own warning is tested elsewhere
    capped = capped_cold_runs(monkeypatch)
    with_filter = []   # per probe, whether it had the seccomp filter
    probe = sandbox_local.LocalSandbox._probe
    monkeypatch.setattr(sandbox_local.LocalSandbox, "_probe",
                        lambda self: with_filter.append(self.seccomp is not None) or probe(self))
    for warm_jails in (True, False):
        with_filter.clear()
        with make_sandbox("local", workers=1, warm_jails=warm_jails) as sandbox:
            assert not sandbox.isolated and "bubblewrap unavailable" in sandbox.isolation, sandbox.isolation
        assert with_filter in ([True, False], [False]), (warm_jails, with_filter)
    assert capped == [], capped


def test_a_cold_init_left_with_a_capability_does_not_run_the_program(cold_local_sandbox, monkeypatch):
    if not cold_local_sandbox.bwrap_base:
        pytest.skip("bubblewrap is not usable here: cold jails need it")
    assert cold_local_sandbox.cold_inode_cap
    keep_capabilities = sandbox_local.COLD_INIT.replace('check(libc.capset(header, sets), "drop the capabilities")',
                                                        "pass")
    assert keep_capabilities != sandbox_local.COLD_INIT
    monkeypatch.setattr(sandbox_local, "COLD_INIT", keep_capabilities)
    result = cold_local_sandbox.run(Program({"main.py": "print('ran')"}))
    assert result.exit_code == 126 and result.stdout == "", result
    assert "capabilities are left after dropping them all: " in result.stderr and "CapEff" in result.stderr, result


def test_cannot_write_outside_the_jail(sandbox, tmp_path):
    marker = uuid.uuid4().hex
    targets = [str(tmp_path / "pwned"), f"/etc/pwned-{marker}", f"/usr/pwned-{marker}", f"/pwned-{marker}",
               f"/dev/pwned-{marker}"]
    source = f"""
written = []
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("pwned")
        written.append(path)
    except OSError:
        pass
print(written)
"""
    result = run(sandbox, source)
    assert result.exit_code == 0, result
    assert not any(os.path.exists(t) for t in targets), result
    assert list(tmp_path.iterdir()) == []


def test_cannot_read_host_secrets(sandbox, tmp_path):
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "secret.txt").write_text(secret)
    allowed_in_root = {p for p in sys.base_prefix.split("/")[2:3] if sys.base_prefix.startswith("/root/")}
    source = f"""
import os
seen = []
for path in [{str(tmp_path / 'secret.txt')!r}, "/etc/shadow", "/root/.bash_history"]:
    try:
        seen.append(open(path).read())
    except OSError:
        pass
try:
    print(sorted(os.listdir("/root")))
except OSError:
    print([])
print(seen)
"""
    result = run(sandbox, source)
    assert result.exit_code == 0, result
    assert secret not in result.stdout and "root:" not in result.stdout, result
    assert set(eval(result.stdout.splitlines()[0])) <= allowed_in_root, result


def test_no_network_to_a_host_loopback_listener(sandbox):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    source = f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"leak")
    print("connected")
except OSError as exc:
    print("refused", exc)
"""
    try:
        result = run(sandbox, source)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()   # nothing ever connected
    finally:
        listener.close()
    assert result.stdout.startswith("refused"), result


def test_killing_its_parent_and_everything(sandbox):
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        source = ("import os, signal\nfor target in (os.getppid(), -1):\n    try:\n"
                  "        os.kill(target, signal.SIGKILL)\n    except OSError:\n        pass\nprint('done')")
        result = run(sandbox, source)
        assert sentinel.poll() is None, "a sandboxed program killed a host process"
        assert result.stdout in ("done\n", ""), result
    finally:
        sentinel.kill()
        sentinel.wait()


def test_no_daemon_survives(sandbox):
    marker = f"rftgym-daemon-{uuid.uuid4().hex}"
    source = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.environ["MARKER"] = {marker!r}
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", {marker!r}], os.environ)
    os._exit(0)
time.sleep(0.3)
print("parent exits")
"""
    result = run(sandbox, source)
    assert result.stdout == "parent exits\n", result
    assert processes_with(marker) == []


def test_printing_gigabytes_is_capped(sandbox):
    result = run(sandbox, "import sys\nblock = 'x' * 2**20\nwhile True:\n    sys.stdout.write(block)")
    assert result.output_truncated and result.limit_hit == "output", result
    assert len(result.stdout) <= sandbox.limits.output_bytes


def test_stderr_flood_is_capped(sandbox):
    result = run(sandbox, "import os\nwhile True:\n    os.write(2, b'e' * 65536)")
    assert result.output_truncated and len(result.stderr) <= sandbox.limits.output_bytes


def test_signal_death_is_reported(sandbox):
    result = run(sandbox, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)")
    assert result.exit_code is None and result.signal == signal.SIGTERM, result


def test_rlimits_seen_inside_are_the_limits(sandbox):
    limits, mb = sandbox.limits, 1 << 20
    source = ("import json, resource\nprint(json.dumps({n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n))"
              " for n in ('CPU', 'NOFILE', 'FSIZE', 'CORE', 'AS')}))")
    result = run(sandbox, source)
    assert result.ok, result
    seen = {name: tuple(pair) for name, pair in json.loads(result.stdout).items()}
    cpu = math.ceil(limits.cpu_seconds)
    expected = {"CPU": (cpu, cpu + 1), "NOFILE": (limits.open_files,) * 2, "FSIZE": (limits.file_size_mb * mb,) * 2,
                "CORE": (0, 0)}
    if sandbox.name == "local":   # docker caps memory with its cgroup instead
        expected["AS"] = (limits.memory_mb * mb,) * 2
    assert {name: seen[name] for name in expected} == expected, seen


@pytest.mark.parametrize("backend", ["local", "local-cold", "docker"])
def test_host_environment_is_not_visible(request, monkeypatch, backend):
    name, value = f"RFTGYM_HOST_SECRET_{uuid.uuid4().hex}", f"value-{uuid.uuid4().hex}"
    monkeypatch.setenv(name, value)   # before the sandbox (and its warm jail) is made
    options = ({"client": request.getfixturevalue("docker_engine")} if backend == "docker"
               else {"warm_jails": backend == "local"})
    source = ("import json, os\nprint(json.dumps(dict(os.environ)))\n"
              "print(open('/proc/self/environ', 'rb').read().decode('latin-1'))")
    with make_sandbox("docker" if backend == "docker" else "local", limits=SandboxLimits(wall_seconds=20),
                      workers=1, **options) as sandbox:
        result = sandbox.run(Program({"main.py": source}))
    assert result.ok and "PATH" in json.loads(result.stdout.splitlines()[0]), result
    assert name not in result.stdout and value not in result.stdout, result


def test_no_capabilities_no_new_privileges_no_nested_user_namespace_own_session(sandbox):
    source = """
import ctypes, os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
libc = ctypes.CDLL(None, use_errno=True)
nested = libc.unshare(0x10000000)   # CLONE_NEWUSER (os.unshare needs Python 3.12)
# The session's leader is the program or the jail's init: in the jail's pid namespace, so not a host
# process (getsid gives 0 for a leader outside the namespace).
print([int(status[k], 16) for k in ("CapEff", "CapPrm", "CapAmb")], int(status["NoNewPrivs"]), nested,
      os.getsid(0) in (os.getpid(), 1))
"""
    result = run(sandbox, source)
    assert result.ok, result
    assert result.stdout == "[0, 0, 0] 1 -1 True\n", result


def test_no_capability_even_in_the_bounding_set_and_the_kernels_settings_read_only(sandbox):
    """No capability a program could ever gain (a warm jail's zygote keeps some; its runs must not
    have them even as bounds), and /proc's settings read-only where runs share a pid namespace."""
    source = """
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
covered = [p for p in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus") if os.path.exists(p)]
print(json.dumps([int(status["CapBnd"], 16), "/proc/sys" in covered,
                  [p for p in covered if not os.statvfs(p).f_flag & os.ST_RDONLY]]))
"""
    result = run(sandbox, source)
    assert result.ok, result
    bounding, has_sys, writable = json.loads(result.stdout)
    assert bounding == 0 and has_sys, result
    # bwrap covers only what its user may write (none of these), and a cold jail's namespaces are
    # its one run's; the warm jail's runs share the zygote's pid namespace, docker covers them.
    if sandbox.name != "local" or sandbox.warm:
        assert writable == [], result


# Every other process of the jail whose memory it could write (code there runs with that
# process's fds: a cold jail's init held the host's output pipes) or whose fds it could reopen.
WRITE_INTO_OTHER_PROCESSES = """
import os
reached = []
for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
    for path in [f"/proc/{pid}/mem", *(f"/proc/{pid}/fd/{fd}" for fd in range(10))]:
        try:
            os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
            reached.append(path)
        except OSError:
            pass
print(reached)
"""


def test_no_other_process_of_the_jail_can_be_written_into_through_proc(sandbox):
    result = run(sandbox, WRITE_INTO_OTHER_PROCESSES)
    assert result.ok and result.stdout == "[]\n", result


# -- warm jails: one jail, many runs ---------------------------------------------------------
@pytest.fixture
def warm(local_sandbox):
    """A local sandbox with a single warm jail (workers=1), so consecutive runs share it."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: warm jails need it")
    with make_sandbox("local", limits=local_sandbox.limits, workers=1) as sandbox:
        assert sandbox.warm
        yield sandbox


def jail(sandbox):
    """The sandbox's idle warm jail (white box: tests tell jails apart by their bwrap process)."""
    assert len(sandbox.jails.idle) == 1, sandbox.jails.idle
    return sandbox.jails.idle[0]


def run_in(sandbox, source: str, **kw):
    return sandbox.run(Program({"main.py": source}, **kw))


LIST_JAIL = """
import os
print(sorted(p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())))
print(sorted(os.listdir(".")), sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm")))  # "." = its work dir
"""


def test_daemon_and_files_of_run_1_are_gone_before_run_2(warm):
    marker = f"rftgym-daemon-{uuid.uuid4().hex}"
    first = run_in(warm, f"""
import os, sys, time
for path in ("left.txt", "/tmp/left.txt", "/dev/shm/left.txt"):  # the first in its work dir (cwd)
    open(path, "w").write("left")
os.makedirs("locked/deeper")
os.chmod("locked", 0)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", {marker!r}])
    os._exit(0)
time.sleep(0.3)
print("left a daemon")
""")
    assert first.ok and first.stdout == "left a daemon\n", first
    before = jail(warm)
    assert processes_with(marker) == []
    second = run_in(warm, LIST_JAIL)
    assert second.ok and second.stdout == "[]\n['main.py'] [] []\n", second
    assert jail(warm) is before, "a clean run must not cost a new jail"


def test_a_directorys_times_carry_nothing_to_the_next_run(warm):
    # A number hidden in the times of the jail's writable dirs, for a later run in the same jail.
    stamp = 1_234_567_891_234_567_891
    first = run_in(warm, f"import os\nfor d in ('/tmp', '/dev/shm', '.'):\n    os.utime(d, ns=({stamp}, {stamp}))\n"
                         "print('stamped')\n")
    assert first.ok and first.stdout == "stamped\n", first
    before = jail(warm)
    second = run_in(warm, "import os\nprint([os.stat(d).st_mtime_ns for d in ('/tmp', '/dev/shm', '.')])\n")
    assert jail(warm) is before and second.ok, second
    assert str(stamp) not in second.stdout, second


def test_signals_to_the_zygote_from_a_run_do_not_reach_it(warm):
    run_in(warm, "print(1)")
    before = jail(warm)
    source = """
import os, signal
for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSTOP, signal.SIGSEGV):
    for target in (os.getppid(), 1, -1):
        try:
            os.kill(target, sig)
        except OSError:
            pass
print("done")
"""
    first = run_in(warm, source)
    assert first.stdout in ("done\n", ""), first
    second = run_in(warm, "print(6 * 7)")
    assert second.ok and second.stdout == "42\n", second
    assert jail(warm) is before


def test_zygote_killed_mid_run_is_a_normal_result_and_the_next_run_works(warm):
    run_in(warm, "print(1)")
    victim = jail(warm)
    results = []
    runner = threading.Thread(target=lambda: results.append(run_in(warm, "import time\ntime.sleep(3)")))
    runner.start()
    time.sleep(0.5)
    signal.pidfd_send_signal(victim.pidfd, signal.SIGKILL)
    runner.join(10)
    (killed,) = results
    assert (killed.exit_code, killed.signal, killed.timed_out) == (None, signal.SIGKILL, False), killed
    assert killed.wall_seconds < 2, killed
    after = run_in(warm, "print('fresh')")
    assert after.ok and after.stdout == "fresh\n", after
    assert jail(warm) is not victim


def test_zygote_killed_while_idle_costs_nothing(warm):
    run_in(warm, "print(1)")
    signal.pidfd_send_signal(jail(warm).pidfd, signal.SIGKILL)
    time.sleep(0.2)
    result = run_in(warm, "print('fresh')")
    assert result.ok and result.stdout == "fresh\n", result


def test_fork_bomb_in_run_1_does_not_starve_run_2(warm):
    bomb = run_in(warm, FORK_BOMB, limits=replace(warm.limits, wall_seconds=2))
    assert not bomb.ok, bomb
    source = COUNT_FORKS
    for _ in range(2):   # the process limit bites per run, at the same count each time
        result = run_in(warm, source)
        assert result.ok and int(result.stdout) == warm.limits.processes - 1, result


def test_a_run_cannot_reach_the_zygote_through_proc_or_ptrace(warm):
    source = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
denied = []
for path in ("/proc/1/mem", "/proc/1/environ", "/proc/1/fd/0", "/proc/1/fd/3"):
    try:
        open(path, "rb").read(1)
    except OSError:
        denied.append(path)
for name in ("/proc/1/fd", "/proc/1/map_files"):
    try:
        os.listdir(name)
    except OSError:
        denied.append(name)
for request in (16, 0x4206):   # PTRACE_ATTACH, PTRACE_SEIZE
    if libc.ptrace(request, 1, None, None) != 0:
        denied.append(request)
print(os.getppid(), denied)
"""
    result = run_in(warm, source)
    assert result.ok, result
    assert result.stdout == ("1 ['/proc/1/mem', '/proc/1/environ', '/proc/1/fd/0', '/proc/1/fd/3', "
                             "'/proc/1/fd', '/proc/1/map_files', 16, 16902]\n"), result


@pytest.mark.parametrize("source", [
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))",
    "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n    i += 1",
    "import time\ntime.sleep(3600)",
    "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)",
], ids=["memory", "disk", "wall", "output"])
def test_a_dirty_run_recycles_the_jail(warm, source):
    run_in(warm, "print(1)")
    before = jail(warm)
    run_in(warm, source, limits=replace(warm.limits, wall_seconds=1.5))
    after = run_in(warm, LIST_JAIL)
    assert after.ok and after.stdout == "[]\n['main.py'] [] []\n", after
    assert jail(warm) is not before, "the jail should have been replaced"


# Moves every counter a run can move in its jail: a tmpfs's inode numbers (files made and removed),
# the pid counter (processes forked), the loopback device's packet counters and SysV IPC ids; it
# leaves nothing behind (so the jail stays in use).
MOVE_THE_COUNTERS = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
for root in ("/work", "/tmp", "/dev/shm"):
    for i in range(1500):
        open(f"{root}/f", "w").close()
        os.unlink(f"{root}/f")
for _ in range(150):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
for _ in range(50):
    udp.sendto(b"x" * 1000, udp.getsockname())
for _ in range(30):
    libc.semctl(libc.semget(0, 1, 0o1600), 0, 0)   # IPC_PRIVATE, IPC_CREAT | 0600; IPC_RMID
print("moved")
"""

# What a run can read of those counters.
READ_THE_COUNTERS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
inodes = []
for root in ("/work", "/tmp", "/dev/shm"):
    open(f"{root}/probe", "w").close()
    inodes.append(os.stat(f"{root}/probe").st_ino)
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
with open("/proc/net/dev") as handle:
    loopback = [line.split()[1:3] for line in handle if line.strip().startswith("lo:")]
semaphores = libc.semget(0, 1, 0o1600)   # IPC_PRIVATE, IPC_CREAT | 0600
libc.semctl(semaphores, 0, 0)   # IPC_RMID
print(inodes, os.getpid(), pid, loopback, semaphores)
"""


def test_nothing_a_run_counted_reaches_the_next_run_in_the_same_jail(warm):
    """Inode numbers, pids, packet counters and IPC ids count what earlier runs did: in a shared
    jail one run could leave a number there for the next. Each run sees them as a fresh jail would."""
    run_in(warm, "print(1)")
    before = jail(warm)
    quiet = run_in(warm, READ_THE_COUNTERS)
    moved = run_in(warm, MOVE_THE_COUNTERS, limits=replace(warm.limits, cpu_seconds=20, wall_seconds=30))
    assert moved.ok and moved.stdout == "moved\n", moved
    after = run_in(warm, READ_THE_COUNTERS)
    assert jail(warm) is before, "all the runs must share the jail for this test to mean anything"
    assert quiet.ok and after.ok, (quiet, after)
    assert after.stdout == quiet.stdout, f"what a run counted reached the next: {quiet.stdout} then {after.stdout}"


def test_a_sysv_semaphore_set_left_by_a_run_is_gone_for_the_next(warm):
    # Semaphores are the SysV IPC the seccomp filter allows; a set outlives its process.
    left = run_in(warm, "import ctypes\nprint(ctypes.CDLL(None).semget(1234, 1, 0o1600) >= 0)")  # IPC_CREAT | 0600
    assert left.ok and left.stdout == "True\n", left
    after = run_in(warm, "import ctypes\nprint(ctypes.CDLL(None).semget(1234, 1, 0), open('/proc/sysvipc/sem').read()"
                         ".count('\\n'))")
    assert after.ok and after.stdout == "-1 1\n", after   # no such set; only the table's header line


SET_THE_ZYGOTES_LIMITS = """
import resource
try:
    resource.prlimit(1, resource.RLIMIT_STACK, (1 << 20, 1 << 20))   # pid 1: the warm jail's zygote
    print("set")
except OSError as exc:
    print("refused", exc.errno)
"""
READ_THE_LIMITS = "import resource\nprint([resource.getrlimit(r) for r in (resource.RLIMIT_STACK, resource.RLIMIT_DATA)])"


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="the filter's architectures")
@pytest.mark.parametrize("backend", ["local", "local-cold"])
def test_a_run_cannot_set_another_processs_rlimits_only_its_own(request, backend):
    sandbox = request.getfixturevalue({"local": "local_sandbox", "local-cold": "cold_local_sandbox"}[backend])
    source = """
import os, resource
outcomes = []
for name, call in [("pid 1", lambda: resource.prlimit(1, resource.RLIMIT_STACK, (1 << 20, 1 << 20))),
                   ("own pid", lambda: resource.prlimit(os.getpid(), resource.RLIMIT_NOFILE)),
                   ("pid 0", lambda: resource.prlimit(0, resource.RLIMIT_NOFILE)),
                   ("setrlimit", lambda: resource.setrlimit(resource.RLIMIT_STACK, (1 << 20, 1 << 20)))]:
    try:
        call()
        outcomes.append((name, "ok"))
    except OSError as exc:
        outcomes.append((name, exc.errno))
print(outcomes)
"""
    result = run(sandbox, source)
    assert result.ok, result
    assert result.stdout == "[('pid 1', 1), ('own pid', 1), ('pid 0', 'ok'), ('setrlimit', 'ok')]\n", result


def test_a_jail_whose_zygote_limits_a_run_changed_is_replaced_even_without_the_filter(monkeypatch):
    """The cleaner's own check, with the seccomp filter (which refuses the change) off."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: warm jails need it")
    monkeypatch.setattr(sandbox_local, "jail_filter", lambda: None)
    with make_sandbox("local", limits=SandboxLimits(wall_seconds=20, cpu_seconds=5), workers=1) as sandbox:
        assert sandbox.warm and "NO seccomp filter" in sandbox.isolation, sandbox.isolation
        before = run_in(sandbox, READ_THE_LIMITS)
        zygote = jail(sandbox)
        changed = run_in(sandbox, SET_THE_ZYGOTES_LIMITS)
        assert changed.ok and changed.stdout == "set\n", changed
        assert sandbox.jails.idle == [], "the jail should have been replaced"
        after = run_in(sandbox, READ_THE_LIMITS)
        assert jail(sandbox) is not zygote and after.stdout == before.stdout, (before, after)


def with_set_up_failing(zygote_source: str) -> str:
    """The zygote's source with each run's namespace set-up failing at once."""
    head, rest = zygote_source.split("\ndef set_up_namespaces(", 1)
    signature, body = rest.split("\n", 1)
    return f"{head}\ndef set_up_namespaces({signature}\n    raise OSError(1, 'set-up refused for a test')\n{body}"


def test_a_run_whose_namespaces_could_not_be_set_up_runs_again_in_a_fresh_jail(warm, monkeypatch):
    run_in(warm, "print(1)")
    warm.jails.idle.pop().kill()   # the next run starts a jail, with the failing zygote
    sound = sandbox_local.ZYGOTE_SOURCE
    monkeypatch.setattr(sandbox_local, "ZYGOTE_SOURCE", with_set_up_failing(sound))
    spawn = warm.jails.spawn

    def spawn_then_heal(*args):
        proc = spawn(*args)
        monkeypatch.setattr(sandbox_local, "ZYGOTE_SOURCE", sound)   # the jail after this one is sound
        return proc

    monkeypatch.setattr(warm.jails, "spawn", spawn_then_heal)
    result = run_in(warm, "print(6 * 7)")
    assert result.ok and result.stdout == "42\n", result   # not exit 126 charged to the program


def test_a_jail_that_cannot_set_up_any_run_is_a_sandbox_error(warm, monkeypatch):
    run_in(warm, "print(1)")
    warm.jails.idle.pop().kill()
    monkeypatch.setattr(sandbox_local, "ZYGOTE_SOURCE", with_set_up_failing(sandbox_local.ZYGOTE_SOURCE))
    with pytest.raises(SandboxError, match="could not be set up.*set-up refused for a test"):
        run_in(warm, "print(1)")


DENY_ALL_DEFAULT_ACL = """
import os, struct
# user::--- group::--- other::--- as the default ACL of /work: files made there later get mode 000
entries = b"".join(struct.pack("<HHI", tag, 0, 0xffffffff) for tag in (0x01, 0x04, 0x20))
os.setxattr("/work", "system.posix_acl_default", struct.pack("<I", 2) + entries)
print(os.listxattr("/work"))
"""


def test_extended_attributes_left_on_a_writable_dir_do_not_reach_the_next_run(warm):
    poisoned = run_in(warm, DENY_ALL_DEFAULT_ACL)
    if not poisoned.ok:
        pytest.skip(f"this file system takes no ACLs or xattrs: {poisoned.stderr[-200:]}")
    assert poisoned.stdout == "['system.posix_acl_default']\n", poisoned
    for _ in range(2):  # the next runs read their own files and find no attribute left
        after = run_in(warm, "import os\nprint(os.listxattr('/work'), os.listxattr('/tmp'), open(__file__).read(5))")
        assert after.ok and after.stdout == "[] [] impor\n", after


def test_a_garbled_zygote_report_means_no_status_and_a_new_jail():
    from rftgym.envs.code.jail_server import CLEANED, EXITED, REPORT
    assert sandbox_warm._parse_report(REPORT.pack(EXITED, 3 << 8, 0), EXITED) == (3 << 8, None)
    assert sandbox_warm._parse_report(REPORT.pack(CLEANED, 0, 0), CLEANED) == (None, None)
    assert sandbox_warm._parse_report(REPORT.pack(CLEANED, 0, 2), CLEANED) == (None, "keys were added")
    for garbled, expected in ((REPORT.pack(b"redy", 0, 0), EXITED), (REPORT.pack(CLEANED, 0, 0), EXITED),
                              (REPORT.pack(EXITED, 0, 0), CLEANED), (REPORT.pack(EXITED, 0, 3), EXITED),
                              (REPORT.pack(CLEANED, 0, 99), CLEANED), (REPORT.pack(EXITED, -1, 0), EXITED)):
        status, dirty = sandbox_warm._parse_report(garbled, expected)
        assert status is None and dirty.startswith("bad report"), garbled


class FakeZygote:
    """The zygote's end of a warm jail's socket, driven by the test: the host side is a real
    WarmJail, collecting a run whose reports arrive when the test sends them."""

    def __init__(self):
        self.host_end, self.end = socket.socketpair()
        self.host_end.setblocking(False)
        self.jail = sandbox_warm.WarmJail(proc=None, sock=self.host_end, disk_mb=16)
        self.out_r, self.out_w = os.pipe()
        self.err_r, self.err_w = os.pipe()

    def collect_in_background(self, wall_seconds: float):
        result = {}
        started = time.monotonic()
        thread = threading.Thread(target=lambda: result.update(outcome=self.jail._collect(
            self.out_r, self.err_r, SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=wall_seconds), started)))
        thread.start()
        return thread, result

    def report(self, tag: bytes, status: int = 0, dirty: int = 0) -> None:
        from rftgym.envs.code.jail_server import REPORT
        self.end.sendall(REPORT.pack(tag, status, dirty))

    def close_pipes(self) -> None:
        os.close(self.out_w)
        os.close(self.err_w)

    def close(self) -> None:
        for fd in (self.out_r, self.err_r):
            os.close(fd)
        self.end.close()
        self.host_end.close()


def test_the_wall_limit_ends_when_the_program_exits_not_when_the_jail_is_clean():
    # The program exits after 0.2 s; the cleanup takes 1.3 s more, past the 1 s wall limit. That
    # used to be reported as a timeout; the run's wall time is 0.2 s and it finished.
    from rftgym.envs.code.jail_server import CLEANED, EXITED
    fake = FakeZygote()
    try:
        thread, result = fake.collect_in_background(wall_seconds=1.0)
        os.write(fake.out_w, b"done\n")
        time.sleep(0.2)
        fake.report(EXITED, 0)
        time.sleep(1.3)
        fake.close_pipes()  # the cleanup killed whatever still held the pipes
        fake.report(CLEANED, 0, 0)
        thread.join(10)
        outcome = result["outcome"]
        assert not outcome.timed_out and outcome.status == 0 and outcome.dirty is None, outcome
        assert outcome.stdout == b"done\n" and 0.15 < outcome.wall < 0.6, outcome
    finally:
        fake.close()


def test_a_program_still_running_at_the_wall_limit_times_out():
    fake = FakeZygote()
    try:
        thread, result = fake.collect_in_background(wall_seconds=0.5)
        thread.join(10)
        outcome = result["outcome"]
        assert outcome.timed_out and outcome.status is None and outcome.wall >= 0.5, outcome
    finally:
        fake.close_pipes()
        fake.close()


def test_a_jail_never_reported_clean_is_dirty_but_the_run_counts(monkeypatch):
    from rftgym.envs.code.jail_server import EXITED
    monkeypatch.setattr(sandbox_warm, "CLEANUP_WAIT_SECONDS", 0.5)
    fake = FakeZygote()
    try:
        thread, result = fake.collect_in_background(wall_seconds=5.0)
        fake.report(EXITED, 1 << 8)
        thread.join(10)
        outcome = result["outcome"]
        assert not outcome.timed_out and outcome.status == 1 << 8, outcome
        assert outcome.dirty == "the jail was not reported clean in time", outcome
    finally:
        fake.close_pipes()
        fake.close()


def test_jails_are_recycled_every_n_runs(warm, monkeypatch):
    monkeypatch.setattr(sandbox_warm, "RECYCLE_AFTER", 3)
    idle_after = []
    for _ in range(7):
        assert run_in(warm, "print(1)").ok
        idle_after.append(warm.jails.idle[0] if warm.jails.idle else None)   # None: the jail was just replaced
    served = Counter(j for j in idle_after if j is not None)
    assert idle_after.count(None) >= 2 and len(served) >= 2 and max(served.values()) <= 2, idle_after


def test_root_filesystem_is_read_only_and_only_loopback_exists(sandbox):
    """What the program sees of its jail: '/' mounted read-only (not just unwritable for its uid)
    and no network interface but loopback."""
    source = """
import os
print(bool(os.statvfs("/").f_flag & os.ST_RDONLY))
with open("/proc/net/dev") as handle:
    print(sorted(line.split(":")[0].strip() for line in handle.readlines()[2:]))
"""
    result = run(sandbox, source)
    assert result.ok, result
    read_only, interfaces = result.stdout.splitlines()
    assert read_only == "True"
    assert interfaces == "['lo']"


def test_docker_container_options_isolate(docker_sandbox):
    """The engine is asked for what the isolation line promises (a dropped option is invisible to
    the behavioural tests when the daemon runs with --bridge=none, so check the request too)."""
    options = docker_sandbox._container_options(docker_sandbox.limits, 0)
    assert options["network_mode"] == "none" and options["read_only"] is True
    assert options["cap_drop"] == ["ALL"] and "no-new-privileges" in options["security_opt"]
    assert options["nano_cpus"] > 0 and options["pids_limit"] == docker_sandbox.limits.processes + 1
    assert options["user"] == "65534:65534" and options["mem_limit"] == options["memswap_limit"]
    assert options["environment"]["PYTHONHASHSEED"] == "0"
    # Inode-capped tmpfs's, /dev/shm too (the engine's own, from shm_size, cannot be capped).
    size = docker_sandbox.limits.disk_mb << 20
    capped = f"size={size},nr_inodes={size // os.sysconf('SC_PAGE_SIZE')},mode=1777"
    assert options["tmpfs"] == {"/work": capped, "/tmp": capped, "/dev/shm": capped} and "shm_size" not in options
    # The engine's own seccomp profile refuses the keyring, process_vm_readv and pidfd_getfd: in force.
    assert "the engine's seccomp profile" in docker_sandbox.isolation, docker_sandbox.isolation
    status = run(docker_sandbox, "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])")
    assert status.stdout == "2\n", status   # SECCOMP_MODE_FILTER


# Scans the run's own readable mappings for each secret, given as two halves that are joined
# only inside the memory being scanned (so the scanner never holds a secret itself). A canary
# the scanner does build proves that the scan sees the heap.
SCAN_MEMORY = """
import json, sys
CHUNK, OVERLAP = 1 << 20, 256
def count(head, tail):
    head, tail = head.encode(), tail.encode()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    hits = 0
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        for fields in regions:
            if not fields[1].startswith("r"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            for pos in range(start, end, CHUNK):
                try:
                    mem.seek(pos)
                    data = mem.read(min(end, pos + CHUNK + OVERLAP) - pos)
                except (OSError, OverflowError, ValueError):
                    break
                i = data.find(head)
                while 0 <= i < CHUNK:
                    hits += data[i + len(head):i + len(head) + len(tail)] == tail
                    i = data.find(head, i + 1)
    return hits
canary = CANARY[0] + CANARY[1]
print(json.dumps({"canary": count(*CANARY), **{name: count(*halves) for name, halves in SECRETS.items()}}))
"""


def test_a_run_cannot_read_an_earlier_runs_program_stdin_or_argv_from_memory(warm):
    """The zygote forks every run, so anything of run A in its heap (even freed) is readable by
    run B: the reference solution must not be recoverable by the candidate run after it."""
    secrets = {name: (f"rftgym-{name}-", uuid.uuid4().hex) for name in ("file", "stdin", "argv")}
    joined = {name: head + tail for name, (head, tail) in secrets.items()}
    reference = (f"# {joined['file']}\nimport sys\nSECRET = {joined['file']!r}\n"
                 "print(len(input()), len(sys.argv), len(SECRET))\n")
    first = warm.run(Program({"main.py": reference, "data/extra.txt": joined["file"] * 50},
                             argv=("python", "main.py", joined["argv"]), stdin=joined["stdin"] + "\n"))
    assert first.ok, first
    before = jail(warm)
    source = f"CANARY = {('rftgym-canary-', uuid.uuid4().hex)!r}\nSECRETS = {secrets!r}\n" + SCAN_MEMORY
    second = run_in(warm, source, limits=replace(warm.limits, cpu_seconds=10, wall_seconds=20))
    assert jail(warm) is before, "both runs must share the jail for this test to mean anything"
    assert second.ok, second
    found = json.loads(second.stdout)
    assert found["canary"] >= 1, f"the scan did not see its own heap: {found}"
    assert (found["file"], found["stdin"], found["argv"]) == (0, 0, 0), f"run A's data is in run B's memory: {found}"


# Memory held in objects rather than in the address space: RLIMIT_AS does not count it.
HOLD_OUTSIDE_ADDRESS_SPACE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
SEGMENT, MIB = 32 << 20, 1 << 20
held, keep = 0, []
for _ in range(8):
    sid = libc.shmget(0, ctypes.c_size_t(SEGMENT), 0o1600)
    if sid < 0:
        break
    address = libc.shmat(sid, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        break
    ctypes.memset(address, 1, SEGMENT)
    libc.shmdt(ctypes.c_void_p(address))
    held += SEGMENT
    print(held // MIB, flush=True)
for _ in range(8):
    try:
        fd = os.memfd_create("hold")
    except OSError:
        break
    keep.append(fd)
    for offset in range(0, SEGMENT, MIB):
        os.pwrite(fd, b"x" * MIB, offset)
    held += SEGMENT
    print(held // MIB, flush=True)
"""


def test_memory_outside_the_address_space_is_refused_or_capped(sandbox):
    result = run(sandbox, HOLD_OUTSIDE_ADDRESS_SPACE)
    held = [int(line) for line in result.stdout.split()]
    # 512 MiB would be held without a cap; the run may hold up to its memory limit (docker's cgroup).
    assert max(held, default=0) <= sandbox.limits.memory_mb, (held, result)


REACH_INTO_PID_1 = """
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
PTRACE, PIDFD_GETFD = (101, 438) if platform.machine() == "x86_64" else (117, 438)
outcomes = []
try:
    pidfd = os.pidfd_open(1)
except OSError as exc:
    outcomes.append(("pidfd_open", exc.errno))
else:
    for fd in (0, 1, 2):   # in a cold jail, its init: bwrap gave it the host's ends of the pipes
        got = libc.syscall(PIDFD_GETFD, pidfd, fd, 0)
        outcomes.append(("pidfd_getfd", fd, got if got >= 0 else -ctypes.get_errno()))
got = libc.syscall(PTRACE, 16, 1, None, None)   # PTRACE_ATTACH
outcomes.append(("ptrace", got if got >= 0 else -ctypes.get_errno()))
print(outcomes)
"""


def test_a_program_cannot_take_the_jail_inits_descriptors(sandbox):
    result = run(sandbox, REACH_INTO_PID_1)
    assert result.ok, result
    outcomes = eval(result.stdout)
    assert all(outcome[-1] < 0 for outcome in outcomes), outcomes  # each refused


# A process that makes itself non-dumpable, as the test runner's supervisor (and the jails' and
# the docker bootstrap's own processes) do, holding a secret in memory and an fd: its parent, the
# program, tries to read the memory, take the fd and attach to it.
REACH_A_NON_DUMPABLE_PROCESS = """
import ctypes, os, platform, time
libc = ctypes.CDLL(None, use_errno=True)
PTRACE, PROCESS_VM_READV, PIDFD_GETFD = (101, 310, 438) if platform.machine() == "x86_64" else (117, 270, 438)

class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]

secret = ctypes.create_string_buffer(b"rftgym-secret", 16)   # at the same address in the forked child
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    libc.prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE, 0
    os.write(ready_w, b"x")
    time.sleep(30)
    os._exit(0)
os.read(ready_r, 1)
secret.value = b"overwritten"
copy = ctypes.create_string_buffer(16)
local, remote = IoVec(ctypes.addressof(copy), 16), IoVec(ctypes.addressof(secret), 16)
outcomes = []
def outcome(name, got):
    outcomes.append((name, got if got >= 0 else -ctypes.get_errno()))
outcome("process_vm_readv", libc.syscall(PROCESS_VM_READV, child, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0))
outcome("pidfd_getfd", libc.syscall(PIDFD_GETFD, os.pidfd_open(child), ready_w, 0))
outcome("ptrace", libc.syscall(PTRACE, 16, child, None, None))   # PTRACE_ATTACH
try:
    with open(f"/proc/{child}/mem", "rb") as mem:
        mem.seek(ctypes.addressof(secret))
        outcome("/proc/pid/mem", len(mem.read(16)))
except OSError as exc:
    outcome("/proc/pid/mem", -exc.errno)
os.kill(child, 9)
os.waitpid(child, 0)
print(outcomes, copy.value)
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64/aarch64")
def test_a_program_cannot_reach_into_a_non_dumpable_process(sandbox):
    """What the docker backend relies on instead of a filter of its own: its engine's profile lets
    ptrace through, but no process that holds anything of the runner's is dumpable."""
    result = run(sandbox, REACH_A_NON_DUMPABLE_PROCESS)
    assert result.ok, result
    outcomes, copied = result.stdout.rsplit(" ", 1)
    assert all(got < 0 for _, got in eval(outcomes)), result.stdout   # each refused
    assert copied.strip() == "b''", result.stdout


KEYRING = """
import ctypes, platform, sys
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, KEYCTL = (248, 250) if platform.machine() == "x86_64" else (217, 219)
GET_KEYRING_ID, SETPERM, LINK, SEARCH, READ = 0, 5, 8, 10, 11
USER_KEYRING = -4

def keyrings_of_uid():
    # Each jail has its own user namespace, but /proc/keys shows every keyring this uid may view,
    # the host's own _uid.65534 among them, and the kernel keeps it across jails.
    own = libc.syscall(KEYCTL, GET_KEYRING_ID, USER_KEYRING, 1)
    try:
        lines = open("/proc/keys").read().splitlines()
    except OSError:
        return []
    return [int(l.split()[0], 16) for l in lines if "keyring" in l and "_uid." in l and int(l.split()[0], 16) != own]

if sys.argv[1] == "store":
    key = libc.syscall(ADD_KEY, b"user", b"rftgym-probe", b"the answers", 11, USER_KEYRING)
    if key > 0:
        libc.syscall(KEYCTL, SETPERM, key, ctypes.c_uint32(0x3F0A0000))
        for ring in keyrings_of_uid():
            libc.syscall(KEYCTL, LINK, key, ring)
    print("stored" if key > 0 else "refused")
else:
    found = any(libc.syscall(KEYCTL, SEARCH, ring, b"user", b"rftgym-probe", 0) > 0
                for ring in [USER_KEYRING, *keyrings_of_uid()])
    print("found" if found else "absent")
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="syscall numbers of x86_64/aarch64")
def test_the_kernel_keyring_carries_nothing_from_one_run_to_another(sandbox):
    stored = sandbox.run(Program({"main.py": KEYRING}, argv=("python", "main.py", "store")))
    found = sandbox.run(Program({"main.py": KEYRING}, argv=("python", "main.py", "find")))
    assert stored.stdout.strip() in ("stored", "refused") and found.stdout.strip() == "absent", (stored, found)


# Four processes of 80 MiB each: every one is under the per-process limit (128 MiB of address
# space), but together they hold more than a run may (run_cap_mb(128, 8) = 216 MiB locally;
# docker's cgroup caps the container at 128 MiB).
SPREAD_MEMORY = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = bytearray(80 << 20)
        block[::4096] = b"x" * len(block[::4096])   # touch every page
        time.sleep(1.5)
        os._exit(0)
    children.append(pid)
print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])
"""


def _memory_capped_per_run(sandbox) -> None:
    if sandbox.name == "local" and sandbox.memory_groups is None:
        pytest.skip(f"no memory cgroup can be made here: {sandbox.memory_cap_note}")


def test_memory_spread_over_processes_is_capped_for_the_run_as_a_whole(sandbox):
    _memory_capped_per_run(sandbox)
    result = run(sandbox, SPREAD_MEMORY, wall=20)
    assert result.limit_hit == "memory", result
    if result.stdout:   # the parent lived to see some of its children killed
        assert -signal.SIGKILL in eval(result.stdout), result


def test_without_the_cgroup_the_same_processes_all_fit_their_own_limit(cold_local_sandbox, monkeypatch):
    # The control for the test above: what stops that program is the cap per run, not RLIMIT_AS.
    _memory_capped_per_run(cold_local_sandbox)
    monkeypatch.setattr(cold_local_sandbox, "memory_groups", None)
    result = run(cold_local_sandbox, SPREAD_MEMORY, wall=20)
    assert result.ok and eval(result.stdout) == [0, 0, 0, 0] and result.limit_hit is None, result


def test_a_runs_memory_cgroup_is_gone_after_the_run_and_a_jails_with_the_jail(local_sandbox, cold_local_sandbox):
    _memory_capped_per_run(local_sandbox)
    parent = local_sandbox.memory_groups.parent.path
    ours = f"rftgym-{os.getpid()}-"

    def our_groups():
        return {name for name in os.listdir(parent) if name.startswith(ours)}

    before = our_groups()
    assert run(cold_local_sandbox, "print(1)").ok
    assert our_groups() == before   # each cold run's group is removed with it
    with make_sandbox("local", limits=local_sandbox.limits, workers=1) as warm:
        assert warm.run(Program({"main.py": "print(1)"})).ok
        (jail,) = warm.jails.idle
        assert os.path.basename(jail.memory_group.path) in our_groups() - before
    assert our_groups() == before
