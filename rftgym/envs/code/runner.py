"""The source of the test-runner program that runs inside the sandbox (stdlib only).

One process runs a candidate against many test inputs. It reads ``tests.json`` (code, setup code,
entry point, inputs and per-test time limit: never expected outputs) and writes one JSON record
per test to the original stdout, between a random per-run marker, as soon as the test ends, so a
run killed midway still reports the tests it finished. Candidate output goes elsewhere: function
style sends fd 1/2 to /dev/null; stdio style points fd 0/1 at per-test files (so ``input()``,
``sys.stdin.buffer``, ``open(0)`` and ``os.write(1, ...)`` all work) and runs the code in a fresh
``__main__`` namespace per test.

Records: ``{"phase": "import"|"entry"|"fatal", "error", "message"}`` for a failure before the
tests, ``{"i", "got", "error", "message", "s"}`` per test, ``{"done": true}`` at the end.

A test's time limit is an alarm that raises in the candidate's code; code that catches it (a bare
``except:`` in a retry loop) or ignores SIGALRM would otherwise run on until the sandbox's limit
for the whole run. A watchdog thread ends the run ``_GRACE`` seconds after a limit that did not
stop its test: that test is reported as a timeout and the ones after it as skipped, as after
``max_timeouts``.
"""

from __future__ import annotations

from .codec import ENCODER_SOURCE

RUNNER_TEMPLATE = r'''
import atexit, builtins, io, json, math, os, signal, sys, threading, time
MARK = __MARK__
__ENCODER__
_channel = os.fdopen(os.dup(1), "w", encoding="utf-8", errors="replace")
_MAX_GOT = 1000000
_GRACE = 1.0   # seconds a test may run past its limit before the watchdog ends the run
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

def _on_alarm(signum, frame):
    raise _Timeout()

def _describe(exc):
    try:
        return type(exc).__name__, str(exc)[:500]
    except BaseException:
        return type(exc).__name__, ""

def _arm(seconds, report):
    with _lock:
        _overrun[:] = [_now() + seconds + _GRACE, report]
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)

def _quiet():
    # The alarm only: the watchdog still guards what runs the candidate's code after the test (the
    # repr of its result, the str of its exception) until _disarm.
    signal.setitimer(signal.ITIMER_REAL, 0)

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
    timeouts = 0
    for i, source in enumerate(cfg["inputs"]):
        if cfg.get("max_timeouts") and timeouts >= cfg["max_timeouts"]:
            _emit({"i": i, "got": None, "error": "Skipped", "message": "not run after a timeout", "s": 0.0})
            continue
        got = error = message = None
        start = time.perf_counter()
        try:
            args = _eval_input(source)
            _arm(cfg["per_test"], _test_overran(i, len(cfg["inputs"]), cfg["per_test"], _now()))
            value = fn(*args)
            _quiet()
            got = _rft_dumps(value)
            if len(got) > _MAX_GOT:
                got, error, message = None, "OutputTooLarge", "the returned value is too large"
        except _Timeout:
            error, message = "Timeout", "the test took longer than %g s" % cfg["per_test"]
            timeouts += 1
        except BaseException as exc:
            _quiet()
            error, message = _describe(exc)
        _disarm()
        _emit({"i": i, "got": got, "error": error, "message": message, "s": time.perf_counter() - start})

class _HardExit(BaseException):
    pass

def _hard_exit(status=0):
    # os._exit in a stdio program ends its test, not the runner (the tests share one process).
    raise _HardExit(status)

def _exit_error(status):
    try:  # the exit status may be any object of the candidate's
        if status not in (None, 0):
            return "SystemExit", "exit status %r" % (status,)
    except BaseException:
        return "SystemExit", "an exit status that cannot be shown"
    return None, None

def _program_end(threads_before):
    # What the interpreter does when a program ends: wait for the threads it started (a program
    # may run its main in a thread with a larger stack) and run its atexit handlers.
    for thread in threading.enumerate():
        if thread not in threads_before and not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()

def _stdio_style(cfg):
    _redirect(2, _null(), "w")
    sys.stderr = open(2, "w", closefd=False)
    try:
        code = compile(cfg["code"], "solution.py", "exec")
    except BaseException as exc:
        error, message = _describe(exc)
        _emit({"phase": "import", "error": error, "message": message})
        return
    timeouts = 0
    for i, data in enumerate(cfg["inputs"]):
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
        os._exit = _hard_exit
        start = time.perf_counter()
        try:
            _arm(cfg["per_test"], _test_overran(i, len(cfg["inputs"]), cfg["per_test"], _now()))
            try:
                namespace = {"__name__": "__main__", "__builtins__": builtins}
                exec(compile(cfg["setup"], "setup.py", "exec"), namespace)
                exec(code, namespace)
            except SystemExit as exc:
                error, message = _exit_error(exc.code)
            _program_end(threads_before)
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
        _disarm()
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

try:
    try:  # a small stack: under RLIMIT_AS the thread's address space is the candidate's loss
        threading.stack_size(1 << 18)
        threading.Thread(target=_watchdog, daemon=True).start()
    except (RuntimeError, ValueError):  # no room for a thread (e.g. one process allowed): the alarms alone
        pass
    threading.stack_size(0)  # the candidate's own threads get the usual stack
    with open("tests.json", encoding="utf-8") as _handle:
        _cfg = json.load(_handle)
    if _cfg["style"] == "function":
        _function_style(_cfg)
    else:
        _stdio_style(_cfg)
    _emit({"done": True})
except BaseException as _exc:
    _error, _message = _describe(_exc)
    _emit({"phase": "fatal", "error": _error, "message": _message})
_channel.flush()
os._exit(0)
'''


def runner_source(marker: str) -> str:
    """The runner program for one run, with its random marker."""
    return RUNNER_TEMPLATE.replace("__MARK__", repr(marker)).replace("__ENCODER__", ENCODER_SOURCE)
