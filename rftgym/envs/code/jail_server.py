"""The supervisor ("zygote") of a warm local-sandbox jail. Standard library only: it runs inside the jail.

:mod:`.sandbox_local` starts it as pid 1 of the jail's pid namespace (``bwrap --as-pid-1``), as
``python -s -c <this source> <fd>``, where ``fd`` is a unix stream socket to the host. It
pre-imports common stdlib modules, then serves one run at a time:

- host -> zygote: the one byte ``CONTROL`` with four fds attached (SCM_RIGHTS): a sealed memfd
  holding the JSON request ``{"files", "argv", "script", "environment", "rlimits"}``, then the run's stdin (a
  memfd), stdout and stderr.
- zygote -> host: two fixed-size ``REPORT``s per run: ``(EXITED, wait status, 0)`` as soon as the
  program has exited (the run's wall time ends there), then ``(CLEANED, 0, dirty)`` once the jail
  is clean again (``dirty`` indexes ``DIRTY``; 0: clean); ``(READY, 0, 0)`` once at start.

The zygote never holds a run's data: every later run is forked from it, and freed memory is not
zeroed, so whatever it had read (say the reference solution) a later run could find in its own
heap. Per run it forks first and closes its copies of the fds; only the child reads the request,
writes the files into the empty /work, starts a new session, takes stdin/stdout/stderr as 0/1/2
(closing everything else, the socket included), applies the rlimits and runs the program:
``script`` runs ``argv[1]`` in the forked interpreter with ``__main__`` semantics (exit code and
traceback as CPython gives them), else ``argv`` is exec'd with ``environment`` added to the
jail's (e.g. another ``PYTHONHASHSEED`` than the zygote's own). All the zygote learns of a run is its
wait status. When the child is gone the zygote kills every other process of the namespace
(``kill(-1)`` from pid 1 reaches them all) and reaps them; a forked cleaner (so that the names it
reads stay out of the zygote too) wipes /work, /tmp and /dev/shm and checks that the jail is as it
started (the tmpfs's empty with their free space back, no SysV IPC objects, no new keys), and
says what is off as its exit code; anything off is reported as dirty and the host replaces the
whole jail.

Integrity: the zygote is non-dumpable, so runs (same uid, no capabilities) can neither ptrace it
nor reach its memory or fds through /proc; as the namespace's init it installs no signal handlers,
so signals from runs do not reach it; it exits when the host's end of the socket closes, or on
anything but ``CONTROL`` with four fds.
"""

import builtins
import ctypes
import errno
import json
import os
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
ROOTS = ("/work", "/tmp", "/dev/shm")   # the jail's writable tmpfs's; /work is the run's cwd
RLIMITS = {"cpu": "RLIMIT_CPU", "as": "RLIMIT_AS", "fsize": "RLIMIT_FSIZE", "nofile": "RLIMIT_NOFILE",
           "nproc": "RLIMIT_NPROC", "core": "RLIMIT_CORE", "msgqueue": "RLIMIT_MSGQUEUE"}
PR_SET_DUMPABLE = 4
CLEAN_SECONDS = 2.0
CONTROL = b"R"                    # host -> zygote, with the request, stdin, stdout and stderr fds
REPORT = struct.Struct("!4sii")   # zygote -> host: tag, wait status, index into DIRTY
READY, EXITED, CLEANED = b"redy", b"exit", b"done"
DIRTY = (None, "processes survive the run", "a writable dir is not clean after the wipe",
         "could not wipe a writable dir", "SysV IPC objects left", "keys were added",
         "the wipe did not finish in time", "the wipe failed",
         "a writable dir keeps extended attributes (e.g. a default ACL)")


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
    sock = socket.socket(fileno=control_fd)
    baseline = snapshot()
    send(sock, READY, 0, 0)
    while True:
        fds = receive(sock)
        if fds is None:
            return   # the host closed the socket (or died): the namespace dies with us
        send(sock, EXITED, run_one(fds, sock, libc), 0)
        send(sock, CLEANED, 0, clean(baseline))


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


def run_one(fds: list, sock: socket.socket, libc) -> int:
    """Fork the run, wait for it (or for the host to go away); its wait status."""
    pid = os.fork()
    if pid == 0:
        child(fds, libc)   # never returns
    for fd in fds:   # the request memfd above all: never read here
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
    return os.waitpid(pid, 0)[1]


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


def child(fds: list, libc) -> None:
    request_fd, *stdio = fds
    try:
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
        import resource
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
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:   # noqa: BLE001 - CPython exits 120 when stdout cannot be flushed
            status = 120 if status == 0 else status
    return status


# -- cleaning up between runs ---------------------------------------------------------------
def snapshot() -> dict:
    """What a clean jail looks like: each root's mode, times and free space, the keys visible."""
    roots = {}
    for root in ROOTS:
        vfs, info = os.statvfs(root), os.lstat(root)
        roots[root] = (stat.S_IMODE(info.st_mode), vfs.f_bfree, vfs.f_ffree, (info.st_atime_ns, info.st_mtime_ns))
    return {"roots": roots, "keys": key_ids()}


def clean(baseline: dict) -> int:
    """Kill everything but pid 1, then wipe and check the jail in a forked cleaner; the index in
    DIRTY of what is still off (0: clean)."""
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
        code = DIRTY.index("the wipe failed")
        try:
            code = wipe(baseline)
        finally:
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    finished = select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]
    os.close(pidfd)
    if not finished:
        os.kill(pid, signal.SIGKILL)
    status = os.waitpid(pid, 0)[1]
    if not finished:
        return DIRTY.index("the wipe did not finish in time")
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
    return code if 0 <= code < len(DIRTY) else DIRTY.index("the wipe failed")


def wipe(baseline: dict) -> int:
    """(In the cleaner.) Empty the writable dirs and check the jail; the index in DIRTY."""
    for root, (mode, bfree, ffree, times) in baseline["roots"].items():
        try:
            os.chmod(root, mode)
            for name in os.listdir(root):
                remove(os.path.join(root, name))
            os.utime(root, ns=times)   # a run could leave a number in a directory's times for the next
            # A default ACL (an xattr, which takes no blocks) on a root would deny every later
            # run its own files there: removed, and a jail where one stays is replaced.
            for name in xattrs(root):
                os.removexattr(root, name)
            if xattrs(root):
                return DIRTY.index("a writable dir keeps extended attributes (e.g. a default ACL)")
            vfs = os.statvfs(root)
            if os.listdir(root) or (vfs.f_bfree, vfs.f_ffree) != (bfree, ffree):
                return DIRTY.index("a writable dir is not clean after the wipe")
        except (OSError, RecursionError):
            return DIRTY.index("could not wipe a writable dir")
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                if len(f.read().splitlines()) > 1:
                    return DIRTY.index("SysV IPC objects left")
        except OSError:
            pass
    if key_ids() != baseline["keys"]:
        return DIRTY.index("keys were added")
    return 0


def xattrs(path: str) -> list[str]:
    try:
        return os.listxattr(path)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):  # a file system without xattrs holds none
            return []
        raise


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def remove(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        os.chmod(path, 0o700)   # a run may have locked its own dirs
        for name in os.listdir(path):
            remove(os.path.join(path, name))
        os.rmdir(path)
    else:
        os.unlink(path)


def key_ids() -> list:
    try:
        with open("/proc/keys") as f:
            return sorted(line.split(None, 1)[0] for line in f if line.strip())
    except OSError:
        return []


if __name__ == "__main__":
    main(int(sys.argv[1]))
