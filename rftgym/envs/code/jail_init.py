"""What the sandboxes' pid-1 programs share: how they run the program as their child.

A cold local jail's init (:data:`.sandbox_local.COLD_INIT`) and the docker container's
bootstrap (:data:`.sandbox_docker.BOOTSTRAP`) are Python sources run with ``python -I -S -c``;
each starts with :data:`RUN_PROGRAM`, whose two functions do the part that must behave the same
on every backend (and as a warm jail's run, see :func:`.jail_server.child`): the signal
dispositions the program starts with, how a program that cannot be executed is reported, and
the exit status the run ends with.
"""

from __future__ import annotations

# Defines exec_program(argv), for the forked child, and exit_as(child), for pid 1. Python ignores
# SIGPIPE and SIGXFSZ, and exec keeps ignored signals ignored: without the reset, `yes | head -1`
# would end with a "Broken pipe" error instead of quietly, and a write past RLIMIT_FSIZE would
# fail with EFBIG instead of killing the program (with SIGXFSZ, which the result reports as the
# file-size limit). pid 1 takes SIGINT's default action (none, for a namespace's init) instead of
# Python's handler, so that the program cannot interrupt it. (``_signal``: the ``signal`` module
# imports ``enum``, which would double an init's start-up time.)
RUN_PROGRAM = r"""
import _signal, os
_signal.signal(_signal.SIGINT, _signal.SIG_DFL)

def exec_program(argv):
    for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):
        _signal.signal(sig, _signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, ("rftgym jail: cannot execute %s: %s\n" % (argv[0], exc.strerror)).encode())
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)

def exit_as(child):
    # Reaps every process left to it (as pid 1 it inherits orphans) until the program exits, then
    # exits as it did: 128 + the signal after a signal death, as a shell reports it.
    while True:
        pid, status = os.wait()
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)
"""
