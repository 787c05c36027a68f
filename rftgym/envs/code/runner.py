"""The source of the test-runner program that runs inside the sandbox (stdlib only).

The runner reads ``tests.json`` (code, setup code, entry point, inputs and per-test time limit:
never expected outputs) and runs the candidate against every input in a forked child. The child
sends one JSON record per test, as soon as the test ends; the runner (the supervisor) checks each
and writes it to the original stdout between a random per-run marker, so a run killed midway
still reports the tests it finished. Candidate output goes elsewhere: function style sends fd 1/2
to /dev/null; stdio style points fd 0/1 at per-test files (so ``input()``, ``sys.stdin.buffer``,
``open(0)`` and ``os.write(1, ...)`` all work) and runs the code in a fresh ``__main__`` namespace
per test. The child never holds the host's stdout, and the supervisor is non-dumpable, so the
candidate cannot write records the host would read.

Records: ``{"phase": "import"|"entry"|"fatal", "error", "message"}`` for a failure before the
tests, ``{"i", "got", "error", "message", "s"}`` per test, ``{"done": true}`` at the end (the
child also sends ``{"ready": true}`` once the code is defined).

A test's time limit is an alarm that raises in the candidate's code, in the child. Code that
catches it, ignores SIGALRM, switches the runner's alarm off (it shares the child's process) or
loops in C where no signal handler runs would run on until the sandbox's limit for the whole run.
So the supervisor, which runs no candidate code, gives each test its limit plus ``_GRACE`` from
the record before it; past that it kills the child, reports the test as a timeout and starts a
new child at the next test (after ``max_timeouts`` timeouts the rest are skipped). A result that
comes past the limit is a timeout too (code that caught the alarm's exception or ignored SIGALRM,
then returned): the child times the call and checks when it returns. Code that also stops that
clock from inside may answer within ``_GRACE``; the supervisor cannot time the call itself (its
records' arrival also holds the input's parse, the result's encoding and the pipe). Where no
second process can be started (a limit of one process), the tests run in the runner itself, with
the alarms and a watchdog thread that ends the run ``_GRACE`` seconds after a limit that did not
stop its test.
"""

from __future__ import annotations

from .codec import ENCODER_SOURCE

RUNNER_TEMPLATE = r'''
import atexit, builtins, gc, io, json, math, os, select, signal, sys, threading, time
MARK = __MARK__
__ENCODER__
_channel = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")
_MAX_GOT = 1000000
_GRACE = __GRACE__   # seconds a test may run past its limit before it is stopped from outside
_now, _sleep, _exit = time.monotonic, time.sleep, os._exit   # the candidate may replace the modules' own
_lock = threading.RLock()   # one record at a time; the watchdog reports under it
_overrun = [None, None]   # the armed limit's deadline (with grace), and what to report when it passes

def _emit(record):
    with _lock:
        _channel.write(MARK + json.dumps(record, separators=(",", ":")) + MARK + "\n")
        _channel.flush()

def _watchdog():
    while True:
        _sleep(0.1)
        with _lock:
            deadline, report = _overrun
            if deadline is not None and _now() > deadline:
                report()
                _channel.flush()
                _exit(0)

class _Timeout(BaseException):
    pass

_alarm_fired = [False]   # a handler that swallows exceptions (atexit's) cannot hide a timeout

def _on_alarm(signum, frame):
    _alarm_fired[0] = True
    raise _Timeout()

def _describe(exc):
    try:
        return type(exc).__name__, str(exc)[:500]
    except BaseException:
        return type(exc).__name__, ""

def _arm(seconds, report):
    _alarm_fired[0] = False
    with _lock:
        _overrun[:] = [_now() + seconds + _GRACE, report]
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)

def _quiet():
    # The alarm only: the watchdog still guards what runs the candidate's code after the test (the
    # repr of its result, the str of its exception) until _disarm.
    signal.setitimer(signal.ITIMER_REAL, 0)

def _overran(ran, seconds):
    # Code that catches the alarm's exception, or ignores SIGALRM, may still return: late, it is a
    # timeout all the same. (Before the call began, the flag is the last test's.)
    return ran[0] is not None and (_alarm_fired[0] or (ran[1] is not None and ran[1] - ran[0] > seconds))

def _check_in_time(ran, seconds):
    if _overran(ran, seconds):
        raise _Timeout()

def _disarm():
    _quiet()
    with _lock:
        _overrun[:] = [None, None]

def _import_overran():
    _emit({"phase": "import", "error": "Timeout",
           "message": "defining the code took too long and did not stop at its time limit"})

def _test_overran(i, total, seconds, started):
    def report():
        _emit({"i": i, "got": None, "error": "Timeout", "s": _now() - started,
               "message": "the test took longer than %g s and did not stop at its time limit (its code caught "
                          "or ignored the limit, or its result took too long to report)" % seconds})
        for j in range(i + 1, total):
            _emit({"i": j, "got": None, "error": "Skipped", "s": 0.0,
                   "message": "not run: an earlier test did not stop at its time limit"})
        _emit({"done": True})
    return report

def _flush_std():
    for stream in (sys.stdout, sys.__stdout__, sys.stderr):
        try:
            stream.flush()
        except BaseException:   # (a timeout in a flush of the program's own is seen by its flag)
            pass

def _program_gone():
    # What the end of a real program does after its exit calls and the flush of stdout, in
    # CPython's order, which the next test's run must not inherit: its namespace dropped by the
    # caller, its objects go, their finalizers running with their globals (a file it opened on fd 1
    # flushes as it closes); stdout is flushed again; an input fileinput still reads is closed. All
    # within the test's time limit.
    gc.collect()
    _flush_std()
    if "fileinput" in sys.modules:
        try:
            sys.modules["fileinput"].close()
        except BaseException:
            pass
    if _alarm_fired[0]:
        raise _Timeout()

def _redirect(fd, path, mode):
    flags = os.O_RDONLY if mode == "r" else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    handle = os.open(path, flags, 0o600)
    if handle != fd:  # the candidate may have closed fd (e.g. open(0) garbage-collected)
        os.dup2(handle, fd)
        os.close(handle)

def _null():
    return os.devnull if os.path.exists(os.devnull) else "rft_null.txt"

def _eval_input(source):
    return eval(source, {"__builtins__": builtins, "math": math})

def _function_style(cfg):
    _redirect(1, _null(), "w")
    _redirect(2, _null(), "w")
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    sys.stdin = io.StringIO("")
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        _arm(cfg["import_seconds"], _import_overran)
        exec(compile(cfg["setup"], "setup.py", "exec"), namespace)
        exec(compile(cfg["code"], "solution.py", "exec"), namespace)
        _disarm()
    except _Timeout:
        _disarm()
        _emit({"phase": "import", "error": "Timeout", "message": "defining the code took too long"})
        return
    except BaseException as exc:
        _quiet()
        error, message = _describe(exc)
        _disarm()
        _emit({"phase": "import", "error": error, "message": message})
        return
    fn = namespace.get(cfg["entry"])
    if not callable(fn):
        _emit({"phase": "entry", "error": "MissingEntryPoint", "message": "no function named %r" % cfg["entry"]})
        return
    _emit({"ready": True})
    timeouts = 0
    for i in range(cfg.get("first", 0), len(cfg["inputs"])):
        source = cfg["inputs"][i]
        if cfg.get("max_timeouts") and timeouts >= cfg["max_timeouts"]:
            _emit({"i": i, "got": None, "error": "Skipped", "message": "not run after a timeout", "s": 0.0})
            continue
        got = error = message = None
        start = time.perf_counter()
        ran = [None, None]   # when the call began and ended, on the runner's clock
        try:
            args = _eval_input(source)
            _arm(cfg["per_test"], _test_overran(i, len(cfg["inputs"]), cfg["per_test"], _now()))
            ran[0] = _now()
            try:
                value = fn(*args)
            finally:
                ran[1] = _now()
            _quiet()
            _check_in_time(ran, cfg["per_test"])
            got = _rft_dumps(value)
            if len(got) > _MAX_GOT:
                got, error, message = None, "OutputTooLarge", "the returned value is too large"
        except _Timeout:
            error, message = "Timeout", "the test took longer than %g s" % cfg["per_test"]
            timeouts += 1
        except BaseException as exc:
            _quiet()
            if _overran(ran, cfg["per_test"]):   # it caught the alarm, then failed otherwise
                error, message = "Timeout", "the test took longer than %g s" % cfg["per_test"]
                timeouts += 1
            else:
                error, message = _describe(exc)
        _disarm()
        _emit({"i": i, "got": got, "error": error, "message": message, "s": time.perf_counter() - start})

class _HardExit(BaseException):
    pass

_test_pid = [None]

def _hard_exit(status=0):
    # os._exit in a stdio program ends its test, not the runner (the tests share one process); in a
    # process the program forked it is the real one.
    if os.getpid() != _test_pid[0]:
        _exit(status)
    raise _HardExit(status)

def _exit_error(status):
    try:  # the exit status may be any object of the candidate's
        if status not in (None, 0):
            return "SystemExit", "exit status %r" % (status,)
    except BaseException:
        return "SystemExit", "an exit status that cannot be shown"
    return None, None

def _program_end(threads_before):
    # What the interpreter does when a program ends: the threading module's exit calls (they wake
    # a ThreadPoolExecutor's idle workers), then wait for the threads the program started (it may
    # run its main in a thread with a larger stack), then its atexit handlers.
    for call in reversed(list(getattr(threading, "_threading_atexits", ()))):
        call()
    for module, flag in (("concurrent.futures.thread", "_shutdown"), ("concurrent.futures.process", "_global_shutdown")):
        if hasattr(sys.modules.get(module), flag):   # those calls closed the pools for good: the next test needs them
            setattr(sys.modules[module], flag, False)
    for thread in threading.enumerate():
        if thread not in threads_before and not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()
    if _alarm_fired[0]:
        raise _Timeout()

def _stdio_style(cfg):
    _redirect(2, _null(), "w")
    sys.stderr = open(2, "w", closefd=False)
    try:
        code = compile(cfg["code"], "solution.py", "exec")
    except BaseException as exc:
        error, message = _describe(exc)
        _emit({"phase": "import", "error": error, "message": message})
        return
    _emit({"ready": True})
    timeouts = 0
    for i in range(cfg.get("first", 0), len(cfg["inputs"])):
        data = cfg["inputs"][i]
        if cfg.get("max_timeouts") and timeouts >= cfg["max_timeouts"]:
            _emit({"i": i, "got": None, "error": "Skipped", "message": "not run after a timeout", "s": 0.0})
            continue
        with open("rft_stdin.txt", "w", encoding="utf-8") as handle:
            handle.write(data)
        _redirect(0, "rft_stdin.txt", "r")
        _redirect(1, "rft_stdout.txt", "w")
        sys.stdin = open(0, "r", encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        error = message = None
        threads_before = set(threading.enumerate())
        atexit._clear()
        os._exit, _test_pid[0] = _hard_exit, os.getpid()
        start = time.perf_counter()
        namespace = None
        ran = [None, None]
        try:
            _arm(cfg["per_test"], _test_overran(i, len(cfg["inputs"]), cfg["per_test"], _now()))
            ran[0] = _now()
            try:
                namespace = {"__name__": "__main__", "__builtins__": builtins}
                exec(compile(cfg["setup"], "setup.py", "exec"), namespace)
                exec(code, namespace)
            except SystemExit as exc:
                error, message = _exit_error(exc.code)
            _program_end(threads_before)
            _flush_std()   # while the program's names are there (a FastIO wrapper flushes through them)
            namespace = None
            _program_gone()
            ran[1] = _now()
            _check_in_time(ran, cfg["per_test"])
            _disarm()
        except _Timeout:
            error, message = "Timeout", "the test took longer than %g s" % cfg["per_test"]
            timeouts += 1
        except _HardExit as exc:  # no thread is waited for and no handler run, as after a real os._exit
            _quiet()
            error, message = _exit_error(exc.args[0] if exc.args else 0)
        except BaseException as exc:
            _quiet()
            error, message = _describe(exc)
        if error != "Timeout" and _overran([ran[0], _now() if ran[1] is None else ran[1]], cfg["per_test"]):
            error, message = "Timeout", "the test took longer than %g s" % cfg["per_test"]   # then exited or failed
            timeouts += 1
        _disarm()
        if namespace is not None:   # a program that failed: its objects go now, not into the next test's output
            namespace = None
            gc.collect()
            _flush_std()
        os._exit = _exit
        atexit._clear()
        seconds = time.perf_counter() - start
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        with open("rft_stdout.txt", "rb") as handle:
            raw = handle.read(_MAX_GOT + 1)
        got = raw[:_MAX_GOT].decode("utf-8", "replace")
        if len(raw) > _MAX_GOT:
            error, message = "OutputTooLarge", "more than %d bytes on stdout" % _MAX_GOT
        _emit({"i": i, "got": got, "error": error, "message": message, "s": seconds})

def _run_tests(cfg, supervised):
    try:
        if not supervised:   # else the supervisor stops what the alarm does not
            try:  # a small stack: under RLIMIT_AS the thread's address space is the candidate's loss
                threading.stack_size(1 << 18)
                threading.Thread(target=_watchdog, daemon=True).start()
            except (RuntimeError, ValueError):  # no room for a thread (e.g. one process allowed): the alarms alone
                pass
            threading.stack_size(0)  # the candidate's own threads get the usual stack
        if cfg["style"] == "function":
            _function_style(cfg)
        else:
            _stdio_style(cfg)
        _emit({"done": True})
    except BaseException as exc:
        error, message = _describe(exc)
        _emit({"phase": "fatal", "error": error, "message": message})
    _channel.flush()
    _exit(0)

# ---- the supervisor: the limits hold whatever the candidate's code does to its own process
#
# The candidate runs in a forked child, and the alarms there stop ordinary slow code. But code in
# that process can reach the runner's own functions (import __main__) and switch its alarm off, or
# loop in C where no signal handler runs. The supervisor never runs candidate code: it relays the
# child's records in order and gives each test (from the record before it) its limit plus _GRACE;
# past that it kills the child, reports a timeout and starts a new child at the next test.

_CHILD_RECORD_BYTES = 16 << 20   # a longer line cannot be a record (a result is capped at _MAX_GOT)

def _non_dumpable(flag):
    # Non-dumpable, the supervisor's /proc entries (its fd of the host's stdout, its memory) and
    # ptrace are closed to the child, which runs as the same user.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(4, flag, 0, 0, 0)   # PR_SET_DUMPABLE
    except BaseException:
        pass

_stopped = [False]   # the supervisor was stopped and continued (SIGCONT), see _supervise

def _on_continue(signum, frame):
    _stopped[0] = True

def _start_child(cfg, first, timeouts_left):
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None, None
    if pid == 0:
        global _channel
        try:
            os.close(read_end)
            signal.signal(signal.SIGCONT, signal.SIG_DFL)
            _non_dumpable(1)
            host, _channel = _channel, os.fdopen(write_end, "w", encoding="utf-8", errors="replace")
            host.close()
            _redirect(1, _null(), "w")   # the host's stdout is the supervisor's alone
            os.setpgid(0, 0)
        except BaseException:
            _exit(1)
        _run_tests(dict(cfg, first=first, max_timeouts=timeouts_left), supervised=True)
    os.close(write_end)
    return pid, read_end

def _stop_child(pid, read_end):
    for target in (-pid, pid):   # its process group, and the child itself if it left the group
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass
    os.close(read_end)
    return os.waitpid(pid, 0)[1]

def _records(read_end, buffer, wait):
    """The complete records the child sent within ``wait`` seconds (None at its end)."""
    ready = select.select([read_end], [], [], max(0.0, wait))[0]
    if not ready:
        return []
    chunk = os.read(read_end, 1 << 16)
    if not chunk:
        return None
    buffer += chunk
    if b"\n" not in chunk:   # a long record comes in many chunks: split once it is whole
        if len(buffer) > _CHILD_RECORD_BYTES:
            buffer.clear()
        return []
    *lines, rest = bytes(buffer).split(b"\n")
    buffer[:] = rest if len(rest) <= _CHILD_RECORD_BYTES else b""
    found = []
    for line in lines:
        text = line.decode("utf-8", "replace")
        if len(text) > 2 * len(MARK) and text.startswith(MARK) and text.endswith(MARK):
            try:
                record = json.loads(text[len(MARK):-len(MARK)])
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                found.append(record)
    return found

def _skip_rest(first, total, why):
    for j in range(first, total):
        _emit({"i": j, "got": None, "error": "Skipped", "message": why, "s": 0.0})
    _emit({"done": True})
    return True

def _supervise(cfg):
    total, per_test = len(cfg["inputs"]), cfg["per_test"]
    max_timeouts = cfg.get("max_timeouts") or 0
    signal.signal(signal.SIGCONT, _on_continue)
    first, timeouts = 0, 0
    while True:
        pid, read_end = _start_child(cfg, first, max(1, max_timeouts - timeouts) if max_timeouts else 0)
        if pid is None:   # no room for another process
            if first == 0:
                return False   # the caller runs the tests itself, under the alarms alone
            return _skip_rest(first, total, "not run: no process could be started after a test that did not stop")
        expected, buffer = None, bytearray()   # None: the code is being defined
        started = _now()
        deadline = started + cfg["import_seconds"] + _GRACE
        while True:
            found = _records(read_end, buffer, min(0.05, deadline - _now()))
            if _stopped[0]:
                # The child, as the same user, may stop the supervisor (SIGSTOP) and run on
                # unwatched: whatever it sent meanwhile cannot be timed, so the test it is on
                # (or the code's definition) is over its limit.
                _stopped[0] = False
                found, deadline = [], _now() - 1.0
            elif found and _now() > deadline:   # read too late to be on time
                found = []
            if found is None:   # the child ended without finishing: the run ends as it did
                status = _stop_child(pid, read_end)
                _channel.flush()
                if os.WIFSIGNALED(status):
                    try:
                        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
                    except (OSError, ValueError):   # SIGKILL and SIGSTOP keep their default anyway
                        pass
                    os.kill(os.getpid(), os.WTERMSIG(status))
                _exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
            for record in found:
                if "phase" in record:   # the code could not be defined, or the runner failed
                    _stop_child(pid, read_end)
                    if first and expected is None:   # defined before, in the first child: the tests ran
                        return _skip_rest(first, total, "not run: the code failed when defined again after a "
                                          "test that did not stop (%s)" % str(record.get("error"))[:100])
                    _emit({"phase": record["phase"] if isinstance(record["phase"], str) else "fatal",
                           "error": str(record.get("error"))[:500], "message": str(record.get("message"))[:500]})
                    return True
                if expected is None and record.get("ready") is True:
                    expected = first
                elif expected is not None and record.get("i") == expected and type(record["i"]) is int:
                    _emit(record)
                    timeouts += record.get("error") == "Timeout"
                    expected += 1
                elif expected == total and record.get("done") is True:
                    _emit({"done": True})
                    _stop_child(pid, read_end)
                    return True
                else:
                    continue
                deadline = _now() + per_test + _GRACE
            if _now() <= deadline:
                continue
            _stop_child(pid, read_end)
            if expected is None and first:
                return _skip_rest(first, total, "not run: defining the code again after a test that did not stop "
                                  "took too long")
            if expected is None:
                _emit({"phase": "import", "error": "Timeout", "message": "defining the code took too long and "
                       "did not stop at its time limit"})
                return True
            _emit({"i": expected, "got": None, "error": "Timeout", "s": _now() - deadline + per_test + _GRACE,
                   "message": "the test took longer than %g s and did not stop at its time limit" % per_test})
            timeouts += 1
            first = expected + 1
            if first >= total or (max_timeouts and timeouts >= max_timeouts):
                return _skip_rest(first, total, "not run after a timeout")
            break

try:
    with open("tests.json", encoding="utf-8") as _handle:
        _cfg = json.load(_handle)
    _non_dumpable(0)
    _supervised = _supervise(_cfg)
except BaseException as _exc:
    _error, _message = _describe(_exc)
    _emit({"phase": "fatal", "error": _error, "message": _message})
    _supervised = True
if not _supervised:
    _run_tests(_cfg, supervised=False)
_channel.flush()
_exit(0)
'''


GRACE_SECONDS = 0.5  # the runner's _GRACE (the host's limit on a quiet run counts it too)


def runner_source(marker: str) -> str:
    """The runner program for one run, with its random marker."""
    return (RUNNER_TEMPLATE.replace("__MARK__", repr(marker)).replace("__GRACE__", repr(GRACE_SECONDS))
            .replace("__ENCODER__", ENCODER_SOURCE))
