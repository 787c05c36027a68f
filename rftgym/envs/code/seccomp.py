"""A seccomp filter for the local jail (bubblewrap's ``--seccomp FD``), in classic BPF.

It refuses (EPERM) the few system calls whose effects escape a jail's limits, and allows the rest:

- ``add_key``, ``request_key``, ``keyctl``: every jail runs as uid 65534, and the kernel keeps that
  uid's user keyring across jails, so a run could store data there (say, the answers of a graded
  task) for any later run to read.
- ``shmget`` (SysV shared memory), ``msgget`` (SysV message queues) and
  ``memfd_create``/``memfd_secret``: memory that lives in an object rather than in the process's
  address space counts neither against RLIMIT_AS nor against the tmpfs size caps, so one run could
  hold gigabytes of host memory (the docker backend caps it with its memory cgroup instead).
  Python code rarely uses them; its shared memory goes through /dev/shm, a size-capped tmpfs in
  the jail. (SysV semaphores stay: they hold almost nothing, and they live in the IPC namespace of
  the run, which a warm jail makes afresh for each run and a cold jail for each jail, so none
  outlives the run that made it.)
- ``ptrace``, ``process_vm_readv``/``process_vm_writev`` and ``pidfd_getfd``: reaching into another
  process of the jail. Nothing a graded program needs uses them. The kernel lets a process reach
  another of the same uid that is dumpable, through these calls and through /proc/<pid>/mem
  (write code into it) and /proc/<pid>/fd (reopen its pipes, which on a non-root host belong to
  the jail's uid): so every process that holds the host's pipes or anything of the test runner's
  (a cold jail's init, see ``sandbox_local.COLD_INIT``; the warm jail's zygote; the runner's
  supervisor) is non-dumpable, and the filter is a second line.
- ``prlimit64`` on another process (a pid other than 0): a warm jail's runs share the uid of the
  zygote they are forked from, and the kernel lets a process of the same uid set another's
  rlimits, which every later run would inherit (its other attributes that runs inherit, nice value,
  CPU affinity and scheduling policy, need a capability the zygote holds and runs do not). The C
  library's ``setrlimit``/``getrlimit`` (Python's ``resource.setrlimit``) pass pid 0; so does
  ``prlimit`` with a command. A program that names its own pid is refused too.

A system call of another ABI (32-bit calls on x86-64, the x32 ABI) is refused too: the numbers
above are the native ones, so another ABI could reach the same calls under other numbers. On a
machine whose architecture is not listed, :func:`jail_filter` returns None and the jail runs
without a filter (the isolation string says so).
"""

from __future__ import annotations

import errno
import platform
import struct
from typing import Sequence

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LOAD_WORD = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JUMP_IF_EQUAL = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JUMP_IF_AT_LEAST = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RETURN = 0x06  # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_REFUSE = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET = 0, 4, 16  # in struct seccomp_data
_X32_BIT = 0x40000000

# (audit arch, {refused call: native number}, {call allowed on the caller only (pid 0): number}) per machine.
_REFUSED = {
    "x86_64": (0xC000003E, {"add_key": 248, "request_key": 249, "keyctl": 250, "shmget": 29, "msgget": 68,
                            "memfd_create": 319, "memfd_secret": 447, "ptrace": 101, "process_vm_readv": 310,
                            "process_vm_writev": 311, "pidfd_getfd": 438}, {"prlimit64": 302}),
    "aarch64": (0xC00000B7, {"add_key": 217, "request_key": 218, "keyctl": 219, "shmget": 194, "msgget": 186,
                             "memfd_create": 279, "memfd_secret": 447, "ptrace": 117, "process_vm_readv": 270,
                             "process_vm_writev": 271, "pidfd_getfd": 438}, {"prlimit64": 261}),
}
_REFUSED["amd64"] = _REFUSED["x86_64"]
_REFUSED["arm64"] = _REFUSED["aarch64"]


def _instruction(code: int, jump_true: int, jump_false: int, value: int) -> bytes:
    return struct.pack("=HBBI", code, jump_true, jump_false, value)


def build_filter(arch: int, numbers: list[int], x32_bit: bool, own_process_only: Sequence[int] = ()) -> bytes:
    """The filter program: refuse ``numbers``, any call of another ABI, and the calls in
    ``own_process_only`` unless their first argument (a pid) is 0; allow the rest. Only the low 32
    bits of that argument are checked: the kernel reads a pid_t from it (little-endian machines)."""
    checks = ([(_JUMP_IF_AT_LEAST, _X32_BIT)] if x32_bit else []) + [(_JUMP_IF_EQUAL, n) for n in numbers]
    length = 3 + len(checks) + 3 * len(own_process_only) + 2  # load arch, check it, load nr; the checks; ALLOW, REFUSE
    allow_at, refuse_at = length - 2, length - 1

    def to(target: int, index: int) -> int:  # a jump counts the instructions after the current one
        return target - (index + 1)

    program = [(_LOAD_WORD, 0, 0, _ARCH_OFFSET),
               (_JUMP_IF_EQUAL, 0, to(refuse_at, 1), arch),  # another ABI: refused
               (_LOAD_WORD, 0, 0, _NR_OFFSET)]
    program += [(code, to(refuse_at, 3 + k), 0, value) for k, (code, value) in enumerate(checks)]
    for number in own_process_only:   # the call's number: load its pid, then allow or refuse (the end either way)
        at = len(program)
        program += [(_JUMP_IF_EQUAL, 0, 2, number),
                    (_LOAD_WORD, 0, 0, _ARG0_OFFSET),
                    (_JUMP_IF_EQUAL, to(allow_at, at + 2), to(refuse_at, at + 2), 0)]
    program += [(_RETURN, 0, 0, _ALLOW), (_RETURN, 0, 0, _REFUSE)]
    assert len(program) == length
    return b"".join(_instruction(*fields) for fields in program)


def jail_filter(machine: str | None = None) -> bytes | None:
    """The jail's filter for this machine (``platform.machine()``), or None where unknown."""
    machine = (machine or platform.machine()).lower()
    if machine not in _REFUSED:
        return None
    arch, numbers, own_process_only = _REFUSED[machine]
    return build_filter(arch, sorted(numbers.values()), x32_bit=machine in ("x86_64", "amd64"),
                        own_process_only=sorted(own_process_only.values()))
