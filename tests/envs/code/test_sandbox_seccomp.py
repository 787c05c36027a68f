"""The local jail's seccomp filter, run on a small classic-BPF interpreter (every architecture it
knows, on any machine), and the warm zygote's check of what runs inherit from it."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import textwrap

import pytest

from rftgym.envs.code.seccomp import jail_filter

ALLOW, REFUSE = 0x7FFF0000, 0x00050000 | errno.EPERM
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# (prlimit64, keyctl, read) per architecture
NUMBERS = {"x86_64": (302, 250, 0), "aarch64": (261, 219, 63)}


def verdict(program: bytes, nr: int, arch: int, pid: int = 0) -> int:
    """What the filter returns for a call (struct seccomp_data: nr, arch, ip, args[6]); the pid
    is the first argument, as a 64-bit register holds it."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, pid & (2**64 - 1), 0, 0, 0, 0, 0)
    instructions = [struct.unpack_from("=HBBI", program, at) for at in range(0, len(program), 8)]
    pc = accumulator = 0
    while True:
        code, jump_true, jump_false, k = instructions[pc]
        if code == 0x20:   # load a word of the data
            accumulator = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code in (0x15, 0x35):   # jump if equal, if at least
            taken = accumulator == k if code == 0x15 else accumulator >= k
            pc += 1 + (jump_true if taken else jump_false)
        elif code == 0x06:
            return k
        else:
            raise AssertionError(f"opcode {code:#x} is not one the filter should use")


@pytest.mark.parametrize("machine", sorted(ARCHES))
def test_prlimit_is_allowed_on_the_caller_only(machine):
    program, arch = jail_filter(machine), ARCHES[machine]
    prlimit64, keyctl, read = NUMBERS[machine]
    assert verdict(program, prlimit64, arch, pid=0) == ALLOW   # setrlimit, getrlimit, prlimit(0, ...)
    for pid in (1, 2, 12345, -1, 2**31 - 1):
        assert verdict(program, prlimit64, arch, pid=pid) == REFUSE, pid
    assert verdict(program, prlimit64, arch, pid=1 << 32) == ALLOW   # the kernel reads a 32-bit pid_t: 0
    assert verdict(program, keyctl, arch) == REFUSE and verdict(program, read, arch) == ALLOW
    assert verdict(program, read, arch ^ 1) == REFUSE   # another ABI
    if machine == "x86_64":
        assert verdict(program, prlimit64 | 0x40000000, arch, pid=0) == REFUSE   # x32


def test_the_zygotes_check_sees_what_a_run_would_inherit_changed():
    """``inherited_attributes`` (the checker's, forked from the zygote) changes with each of the
    zygote's rlimits, nice value and CPU affinity; checked in a child process that changes its own."""
    script = textwrap.dedent("""
        import os, resource
        from rftgym.envs.code.jail_server import inherited_attributes
        baseline = inherited_attributes()
        assert inherited_attributes() == baseline
        seen = []
        soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
        resource.setrlimit(resource.RLIMIT_STACK, (1 << 20, hard))
        seen.append(inherited_attributes() != baseline)
        resource.setrlimit(resource.RLIMIT_STACK, (soft, hard))
        seen.append(inherited_attributes() == baseline)
        os.nice(1)
        seen.append(inherited_attributes() != baseline)
        baseline = inherited_attributes()
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            os.sched_setaffinity(0, cpus[:1])
            seen.append(inherited_attributes() != baseline)
        print(seen)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = eval(done.stdout)
    assert len(seen) >= 3 and all(seen), seen
    if len(os.sched_getaffinity(0)) > 1:
        assert len(seen) == 4, seen
