"""The supervisor ("zygote") of a warm local-sandbox jail. Standard library only: it runs inside the jail.

:mod:`.sandbox_local` starts it as pid 1 of the jail's pid namespace (``bwrap --as-pid-1``), as
``python -s -c <this source> <fd>``, where ``fd`` is a unix stream socket to the host, with
``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN`` and ``CAP_SETPCAP`` in the jail's own user namespace (which
every run drops, from its bounding set too, before it reads its request). It pre-imports common
stdlib modules, then serves one run at a time:

- host -> zygote: the one byte ``CONTROL`` with four fds attached (SCM_RIGHTS): a sealed memfd
  holding the JSON request ``{"files", "argv", "script", "environment", "rlimits"}``, then the run's stdin (a
  memfd), stdout and stderr.
- zygote -> host: two fixed-size ``REPORT``s per run: ``(EXITED, wait status, 0)`` as soon as the
  program has exited (the run's wall time ends there), then ``(CLEANED, 0, dirty)`` once the jail
  is clean again (``dirty`` indexes ``DIRTY``; 0: clean); ``(READY, 0, 0)`` once at start.

The zygote never holds a run's data: every later run is forked from it, and freed memory is not
zeroed, so whatever it had read (say the reference solution) a later run could find in its own
heap. Per run it forks first and closes its copies of the fds; only the child reads the request.
The child first gets namespaces of its own (below), then writes the files into its empty /work,
starts a new session, takes stdin/stdout/stderr as 0/1/2 (closing everything else, the socket
included), applies the rlimits and runs the program: ``script`` runs ``argv[1]`` in the forked
interpreter with ``__main__`` semantics (exit code and traceback as CPython gives them), else
``argv`` is exec'd with ``environment`` added to the jail's (e.g. another ``PYTHONHASHSEED`` than
the zygote's own). All the zygote learns of a run is its wait status. When the child is gone the
zygote kills every other process of its namespace (``kill(-1)`` from pid 1 reaches them all) and
reaps them; a forked checker (so that what it reads stays out of the zygote) checks that no key
was added to the keyring and that what it inherited from the zygote (rlimits, nice value, CPU
affinity, scheduling policy: a process of the same uid may set another's rlimits, see
:mod:`.seccomp`) is as at start, and says what is off as its exit code; anything off is reported
as dirty and the host replaces the whole jail. A run whose namespaces could not be set up is
reported so (before anything else off), and the host runs it again in a fresh jail.

No state of the kernel that a run can change reaches the next run: neither the files it wrote
nor the counters of what it did (a tmpfs's inode numbers count the files ever made in it, the
pid counter the processes ever forked, the loopback device the packets it carried, SysV IPC the
ids it gave out). At start the jail's init forks the zygote proper into a new pid (and mount)
namespace of the jail's own user namespace, where it is pid 1, has its own /proc (with
/proc/sys, /proc/sysrq-trigger, /proc/irq and /proc/bus read-only) and
may set the pid counter: before each run it sets the counter back, so every run's process is
pid 2 and its children's pids follow from what it does alone. The run's process unshares new
mount, IPC and network namespaces, mounts fresh, size-capped tmpfs's on /work, /tmp and /dev/shm
(the sizes and modes of the jail's own, which no run sees; one inode per page of the size, since
inodes are kernel memory that no size counts: :func:`inode_cap`), brings its new loopback device
up and drops every capability; its files, IPC objects and network go when its last process does.

Integrity: the zygote (and the jail's init, which only waits for it, outside the runs' pid
namespace) is non-dumpable, so runs (same uid, no capabilities) can neither ptrace it nor reach
its memory or fds through /proc; it keeps capabilities that runs lack, so the kernel refuses them
its nice value, CPU affinity and scheduling policy; the seccomp filter refuses them its rlimits;
as the namespace's init it installs no signal handlers, so signals from runs do not reach it; it
exits when the host's end of the socket closes, or on anything but ``CONTROL`` with four fds.

What the runs of one jail still share: its user namespace (whose keyring the seccomp filter
refuses, and which is checked after each run), its hostname, and what every process on the
machine shares whatever the backend: kernel-wide counters (forks since boot in /proc/stat, the
inode numbers of pipes and sockets), load, free memory, time. An earlier run can move such a
counter for a later one to read, so two programs that collude can pass a number between them,
through the noise of everything else the machine does; but neither learns from it anything that
the other's code could not compute itself: no run but the reference's ever holds a test's
expected output, and the test runner's own footprint there does not depend on it.
"""

import builtins
import ctypes
import errno
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import stat
import struct
import sys
import time
import types

PRELOAD = ("abc", "array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
           "fractions", "functools", "hashlib", "heapq", "importlib.machinery", "io", "itertools", "json",
           "math", "operator", "random", "re", "statistics", "string", "struct", "textwrap", "traceback",
           "typing")
ROOTS = ("/work", "/tmp", "/dev/shm")   # the writable tmpfs's, fresh per run; /work is the run's cwd
RLIMITS = {"cpu": "RLIMIT_CPU", "as": "RLIMIT_AS", "fsize": "RLIMIT_FSIZE", "nofile": "RLIMIT_NOFILE",
           "nproc": "RLIMIT_NPROC", "core": "RLIMIT_CORE", "msgqueue": "RLIMIT_MSGQUEUE"}
PR_SET_DUMPABLE, PR_CAPBSET_READ, PR_CAPBSET_DROP = 4, 23, 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x08000000, 0x40000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 0x1, 0x2, 0x4, 0x8, 0x20, 0x1000
MS_REC, MS_PRIVATE = 0x4000, 0x40000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
CAPABILITY_VERSION_3 = 0x20080522
LAST_PID = "/proc/sys/kernel/ns_last_pid"   # of the reader's pid namespace
# The kernel's and the devices' settings, read-only in the zygote's fresh /proc as docker has them
# (bwrap covers the same paths in its own /proc where its user could write them).
PROC_COVERED = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
LAST_CAP = "/proc/sys/kernel/cap_last_cap"
CLEAN_SECONDS = 2.0
CONTROL = b"R"                    # host -> zygote, with the request, stdin, stdout and stderr fds
REPORT = struct.Struct("!4sii")   # zygote -> host: tag, wait status, index into DIRTY
READY, EXITED, CLEANED = b"redy", b"exit", b"done"
SET_UP = b"+"                     # a run's process -> the zygote: its namespaces are ready
NOT_SET_UP = "the run's namespaces could not be set up"   # the program never ran
DIRTY = (None, "processes survive the run", "keys were added", "the check did not finish in time",
         "the check failed", NOT_SET_UP,
         "the zygote's rlimits, nice value, CPU affinity or scheduling policy changed")
SUPERVISORS = 2   # the jail's init and the zygote: the uid's processes besides the run's own


class CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapabilitySets(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def main(control_fd: int) -> None:
    for module in PRELOAD:
        try:
            __import__(module)
        except ImportError:
            pass
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # pid 1 without a handler: runs cannot signal it
    os.chdir("/")
    last_pid = become_zygote(libc, control_fd)
    sock = socket.socket(fileno=control_fd)
    mounts = run_mounts()
    reset_pids(last_pid)   # here, where a failure stops the jail before it is used
    jail_caps = bounding_set(libc)
    baseline = (key_ids(), inherited_attributes())
    # What a run inherits is moved out of the collector's sight: finish()'s collection then scans
    # only the program's own objects (a millisecond or more saved per run), and touches none of the
    # inherited pages, which would each be copied from the zygote.
    gc.freeze()
    send(sock, READY, 0, 0)
    while True:
        fds = receive(sock)
        if fds is None:
            return   # the host closed the socket (or died): the namespace dies with us
        reset_pids(last_pid)
        status, problem = run_one(fds, sock, libc, mounts, jail_caps)
        send(sock, EXITED, status, 0)
        found = clean(baseline)   # a failed set-up first: the host tells it from a dirty run
        send(sock, CLEANED, 0, problem or found)


def send(sock: socket.socket, tag: bytes, status: int, dirty: int) -> None:
    sock.sendall(REPORT.pack(tag, status, dirty))


def receive(sock: socket.socket):
    """[request, stdin, stdout, stderr] fds, or None when the host is gone. Only the fixed control
    byte is read here: the request itself is for the forked child alone."""
    data, fds, flags, _ = socket.recv_fds(sock, len(CONTROL), 4)
    if data == CONTROL and len(fds) == 4 and not flags & socket.MSG_CTRUNC:
        return fds
    for fd in fds:
        os.close(fd)
    if not data:
        return None
    raise RuntimeError(f"expected the control byte with 4 fds, got {len(data)} bytes, {len(fds)} fds (flags {flags})")


def become_zygote(libc, control_fd: int) -> int:
    """Fork the zygote proper into a pid namespace of the jail's user namespace (bwrap's own
    belongs to the one above, where the jail has no capability), with its own /proc there, and
    return in it: an fd to write its pid counter. This process, the jail's init, waits for it and
    then ends the jail."""
    check(libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare the zygote's pid namespace")
    pid = os.fork()
    if pid != 0:
        os.close(control_fd)
        os.waitpid(pid, 0)
        os._exit(0)
    check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
          "mount the zygote's /proc")
    last_pid = os.open(LAST_PID, os.O_WRONLY | os.O_CLOEXEC)   # before /proc/sys is read-only
    cover_proc(libc)
    return last_pid


def cover_proc(libc) -> None:
    """Bind each of PROC_COVERED that exists read-only onto itself."""
    for path in PROC_COVERED:
        if not os.path.exists(path):
            continue
        target = path.encode()
        check(libc.mount(target, target, None, MS_BIND | MS_REC, None), f"bind {path}")
        check(libc.mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                         None), f"make {path} read-only")


def bounding_set(libc) -> list:
    """The capabilities in the jail's bounding set (those bwrap was told to add)."""
    with open(LAST_CAP) as f:
        last = int(f.read())
    return [cap for cap in range(last + 1) if libc.prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1]


def reset_pids(last_pid: int) -> None:
    """Set the pid counter back: the next process forked is pid 2, as in every run."""
    if os.pwrite(last_pid, b"1", 0) != 1:
        raise OSError(errno.EIO, f"could not write {LAST_PID}")


def run_one(fds: list, sock: socket.socket, libc, mounts: list, jail_caps: list) -> tuple[int, int]:
    """Fork the run, wait for it (or for the host to go away); its wait status and the index in
    DIRTY of what went wrong (0: nothing)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        child(fds, ready_w, libc, mounts, jail_caps)   # never returns
    for fd in (*fds, ready_w):   # the request memfd above all: never read here
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(sock, select.POLLIN)
    while True:
        if any(fd == sock.fileno() for fd, _ in poller.poll()):
            os._exit(0)   # the host hung up (or broke protocol) mid-run: end the whole namespace
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            break
    os.close(pidfd)
    set_up = os.read(ready_r, len(SET_UP)) == SET_UP   # written before the program ran, or never
    os.close(ready_r)
    return os.waitpid(pid, 0)[1], 0 if set_up else DIRTY.index(NOT_SET_UP)


def inode_cap(size_bytes: int) -> int:
    """The inodes a run's tmpfs of ``size_bytes`` may hold, on every backend: one per page of the
    size (a file that holds anything takes a page anyway). An empty file costs no page, but its
    inode is kernel memory that no size cap or rlimit counts. At least 1: nr_inodes=0 means no cap."""
    return max(1, size_bytes // os.sysconf("SC_PAGE_SIZE"))


def run_mounts() -> list:
    """mount(2) arguments for a run's fresh copies of the jail's tmpfs's, their inodes capped
    by :func:`inode_cap`."""
    mounts = []
    for root in ROOTS:
        vfs, mode = os.statvfs(root), stat.S_IMODE(os.lstat(root).st_mode)
        size = vfs.f_blocks * vfs.f_frsize
        options = f"size={size},nr_inodes={inode_cap(size)},mode={mode:o}".encode()
        mounts.append((b"tmpfs", root.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options))
    return mounts


def set_up_namespaces(libc, mounts: list, jail_caps: list) -> None:
    """(In a run's process.) Its own mount, IPC and network namespaces, with fresh tmpfs's and
    loopback; then no capability, and none in its bounding set."""
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWNET), "unshare the run's namespaces")
    # Private, so that no mount of the run's can ever propagate into the zygote's namespace.
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make the run's mounts private")
    for source, target, kind, flags, options in mounts:
        check(libc.mount(source, target, kind, flags, options), f"mount a fresh tmpfs on {target.decode()}")
    loopback_up()
    drop_capabilities(libc, jail_caps)


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack_from("16sH", fcntl.ioctl(probe, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(probe, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def drop_capabilities(libc, jail_caps: list) -> None:
    """Drop every capability, from the bounding set too (bwrap set no_new_privs, so none can
    come back through an exec anyway), and check that none is left."""
    for cap in jail_caps:   # needs CAP_SETPCAP in the effective set, which the bounding set does not change
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap} from the bounding set")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear the ambient capabilities")
    header, sets = CapabilityHeader(CAPABILITY_VERSION_3, 0), (CapabilitySets * 2)()
    check(libc.capset(ctypes.byref(header), sets), "drop the capabilities")
    check(libc.capget(ctypes.byref(header), sets), "read the capabilities")
    if any(getattr(s, name) for s in sets for name in ("effective", "permitted", "inheritable")):
        raise OSError(errno.EPERM, "capabilities are left after dropping them all")


def check(result: int, what: str) -> None:
    """Raise, saying what failed, if a libc call returned an error."""
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"could not {what}: {os.strerror(code)}")


def read_request(fd: int) -> dict:
    size = os.fstat(fd).st_size
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, size - offset, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return json.loads(b"".join(chunks))


def write_files(files: dict) -> None:
    for path, text in files.items():
        target = os.path.join(ROOTS[0], path)
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)


def child(fds: list, ready_fd: int, libc, mounts: list, jail_caps: list) -> None:
    request_fd, *stdio = fds
    try:
        try:
            set_up_namespaces(libc, mounts, jail_caps)
        except OSError as exc:   # reported as not set up: the host runs the program in a fresh jail
            os.write(stdio[2], f"rftgym jail: could not set up the run's own namespaces: {exc}\n".encode())
            os._exit(126)
        os.write(ready_fd, SET_UP)
        os.close(ready_fd)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)   # its own /proc entries behave as in a fresh process
        try:
            request = read_request(request_fd)
            write_files(request["files"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            os.write(stdio[2], f"rftgym jail: could not write the program files: {exc}\n".encode())
            os._exit(1)
        os.setsid()
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.chdir(ROOTS[0])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name, (soft, hard) in request["rlimits"].items():
            resource.setrlimit(getattr(resource, RLIMITS[name]), (soft, hard))
        argv = request["argv"]
        if request["script"]:
            os._exit(run_script(argv[1], argv[2:]))
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):   # what exec'd programs expect
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update(request.get("environment") or {})
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(2, f"rftgym jail: cannot execute {argv[0]}: {exc.strerror}\n".encode())
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    except BaseException as exc:   # noqa: BLE001 - the child must never return into the zygote loop
        try:
            os.write(2, f"rftgym jail: could not start the program: {exc!r}\n".encode())
        finally:
            os._exit(126)


def run_script(path: str, args: list) -> int:
    """What ``python path *args`` does, in this (forked) interpreter; the exit status."""
    import importlib.machinery
    sys.argv = [path, *args]
    path = os.path.abspath(path)   # as __file__ and in tracebacks, like CPython >= 3.9
    sys.path[0] = os.path.dirname(path)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        sys.stderr.write(f"{sys.executable}: can't open file {path!r}: "
                         f"[Errno {exc.errno}] {exc.strerror}\n")
        return 2
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                           __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = module
    status = 0
    try:
        try:
            code = compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as exc:
            sys.excepthook(type(exc), exc.with_traceback(None), None)   # CPython prints no traceback for it
            return finish(1)
        exec(code, module.__dict__)
    except SystemExit as exc:
        status = exit_status(exc.code)
    except BaseException as exc:   # noqa: BLE001 - reported as CPython would
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None   # from the program's own frame
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        if isinstance(exc, KeyboardInterrupt):
            finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        status = 1
    module = None   # finish() drops sys.modules' reference: the program's objects then go
    return finish(status)


def exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:   # noqa: BLE001
        pass
    return 1


def finish(status: int = 0) -> int:
    """Interpreter shutdown as far as a program can see it: threads joined, atexit run, stdio flushed."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except SystemExit as exc:
        status = exit_status(exc.code)
    except BaseException:   # noqa: BLE001
        pass
    # CPython's order: stdout flushed while the program's names are there (a FastIO wrapper flushes
    # through them), then its module goes (the caller dropped its own reference), its finalizers
    # running with their globals (a file it opened on fd 1 flushes as it closes), then stdout again.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001 - said below, as CPython says it
            pass
    try:
        sys.modules.pop("__main__", None)
        gc.collect()
    except BaseException:   # noqa: BLE001 - a finalizer of the program's own
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001 - CPython exits 120 when stdout cannot be flushed
            status = 120 if status == 0 else status
    return status


# -- cleaning up between runs ---------------------------------------------------------------
def clean(baseline: tuple) -> int:
    """Kill everything but pid 1, then check the jail in a forked checker; the index in DIRTY of
    what is still off (0: clean). ``baseline``: the keyring's key ids and :func:`inherited_attributes`
    at start. The run's files, IPC objects and network went with its namespaces."""
    deadline = time.monotonic() + CLEAN_SECONDS
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        if not [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]:
            break
        if time.monotonic() > deadline:
            return DIRTY.index("processes survive the run")
        time.sleep(0.001)
    pid = os.fork()
    if pid == 0:
        code = DIRTY.index("the check failed")
        try:
            keys, attributes = baseline
            if key_ids() != keys:
                code = DIRTY.index("keys were added")
            elif inherited_attributes() != attributes:   # the checker's are the zygote's: forked from it
                code = DIRTY.index("the zygote's rlimits, nice value, CPU affinity or scheduling policy changed")
            else:
                code = 0
        finally:
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    finished = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]
    os.close(pidfd)
    if not finished:
        os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    if not finished:
        return DIRTY.index("the check did not finish in time")
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    return code if 0 <= code < len(DIRTY) else DIRTY.index("the check failed")


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def inherited_attributes() -> tuple:
    """What a process forked from this one inherits that a process of the same uid may change in
    the zygote: its rlimits (prlimit; refused to runs by the seccomp filter), nice value, CPU
    affinity and scheduling policy (refused to runs for lack of the zygote's capabilities). The
    checker reads its own, i.e. what the next run would start with."""
    limits = tuple((name, resource.getrlimit(getattr(resource, name)))
                   for name in sorted(dir(resource)) if name.startswith("RLIMIT_"))
    return (limits, os.getpriority(os.PRIO_PROCESS, 0), tuple(sorted(os.sched_getaffinity(0))),
            os.sched_getscheduler(0), os.sched_getparam(0).sched_priority)


def key_ids() -> list:
    try:
        with open("/proc/keys") as f:
            return sorted(line.split(None, 1)[0] for line in f if line.strip())
    except OSError:
        return []


if __name__ == "__main__":
    main(int(sys.argv[1]))
