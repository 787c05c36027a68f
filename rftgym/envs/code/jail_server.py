"""The supervisor ("zygote") of a warm local-sandbox jail. Standard library only: it runs inside the jail.

:mod:`.sandbox_local` starts it as pid 1 of the jail's pid namespace (``bwrap --as-pid-1``), as
``python -E -s -c <this source> <fd>``, where ``fd`` is a unix stream socket to the host. It
pre-imports common stdlib modules, then serves one run at a time:

- host -> zygote: a 4-byte big-endian length and a JSON request ``{"files", "argv", "script",
  "rlimits"}``, with the run's stdin, stdout and stderr fds attached to its first bytes (SCM_RIGHTS).
- zygote -> host: one JSON line per run, ``{"status": wait status, "dirty": null or why}``, sent
  once the jail is clean again; ``{"ready": true}`` once at start.

Per run it writes the files into the empty /work and forks a child that starts a new session,
takes the three fds as 0/1/2 (and closes everything else, the socket included), applies the
rlimits, and runs the program: ``script`` runs ``argv[1]`` in the forked interpreter with
``__main__`` semantics (exit code and traceback as CPython gives them), else ``argv`` is exec'd.
When the child is gone it kills every other process of the namespace (``kill(-1)`` from pid 1
reaches them all), reaps them, wipes /work, /tmp and /dev/shm, and checks that the jail is as it
started (only pid 1 left, the tmpfs's empty with their free space back, no SysV IPC objects, no
new keys); anything else is reported as dirty and the host replaces the whole jail.

Integrity: the zygote is non-dumpable, so runs (same uid, no capabilities) can neither ptrace it
nor reach its memory or fds through /proc; as the namespace's init it installs no signal handlers,
so signals from runs do not reach it; it exits when the host's end of the socket closes.
"""

import builtins
import ctypes
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
    send(sock, {"ready": True})
    while True:
        request = receive(sock)
        if request is None:
            return   # the host closed the socket (or died): the namespace dies with us
        message, fds = request
        status = run_one(message, fds, sock, libc)
        send(sock, {"status": status, "dirty": clean(baseline)})


def send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def receive(sock: socket.socket):
    """(request, [stdin, stdout, stderr]) or None when the host is gone."""
    data, fds, flags, _ = socket.recv_fds(sock, 1 << 16, 3)
    if not data:
        return None
    if flags & socket.MSG_CTRUNC or len(fds) != 3:
        raise RuntimeError(f"expected 3 fds with the request, got {len(fds)} (flags {flags})")
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return None
        data += chunk
    return json.loads(data[4:]), fds


def run_one(request: dict, fds: list, sock: socket.socket, libc) -> int:
    """Write the files, fork the run, wait for it (or for the host to go away); its wait status."""
    try:
        write_files(request["files"])
    except OSError as exc:
        os.write(fds[2], f"rftgym jail: could not write the program files: {exc}\n".encode())
        for fd in fds:
            os.close(fd)
        return 1 << 8
    pid = os.fork()
    if pid == 0:
        child(request, fds, libc)   # never returns
    for fd in fds:
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


def write_files(files: dict) -> None:
    for path, text in files.items():
        target = os.path.join(ROOTS[0], path)
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)


def child(request: dict, fds: list, libc) -> None:
    try:
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)   # its own /proc entries behave as in a fresh process
        os.setsid()
        for target, fd in enumerate(fds):
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
    """What a clean jail looks like: each root's mode and free space, the keys visible."""
    roots = {}
    for root in ROOTS:
        vfs = os.statvfs(root)
        roots[root] = (stat.S_IMODE(os.lstat(root).st_mode), vfs.f_bfree, vfs.f_ffree)
    return {"roots": roots, "keys": key_ids()}


def clean(baseline: dict) -> str | None:
    """Kill everything but pid 1, wipe the writable dirs, and say what is still off (None: clean)."""
    deadline = time.monotonic() + CLEAN_SECONDS
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        others = [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]
        if not others:
            break
        if time.monotonic() > deadline:
            return f"processes survive: {others[:5]}"
        time.sleep(0.001)
    for root, (mode, bfree, ffree) in baseline["roots"].items():
        try:
            os.chmod(root, mode)
            for name in os.listdir(root):
                remove(os.path.join(root, name))
            vfs = os.statvfs(root)
            if os.listdir(root) or (vfs.f_bfree, vfs.f_ffree) != (bfree, ffree):
                return f"{root} not clean after the wipe"
        except (OSError, RecursionError) as exc:
            return f"could not wipe {root}: {exc!r}"
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                if len(f.read().splitlines()) > 1:
                    return f"SysV IPC {kind} objects left"
        except OSError:
            pass
    if key_ids() != baseline["keys"]:
        return "keys were added"
    return None


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
