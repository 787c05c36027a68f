"""Running under a launcher (torchrun, accelerate launch): this process's rank, an error reported
once for the run, and leaving the process group."""

from __future__ import annotations

import os
import sys


def _launch() -> tuple[int, int]:
    """This process's rank and the number of processes, as torchrun or accelerate launch set them
    (``(0, 1)`` for a plain process)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def _report_error(prog: str, exc: BaseException, message: str, same_on_every_rank: bool, details=None) -> None:
    """Print ``PROG: error: message`` (after ``details()``, e.g. a traceback). Under a launcher
    every rank has its part of the error, and the user reads each error once: the rank that reports
    it (:func:`~rftgym.train.distributed.who_reports`) prints it, with its rank unless every rank
    stopped with it, and the others one line that names that rank."""
    rank, world = _launch()
    if world <= 1:
        if details is not None:
            details()
        print(f"{prog}: error: {message}", file=sys.stderr)
        return
    from ..train.distributed import who_reports

    report = who_reports(exc, rank, world, same_on_every_rank)
    if report.reporter != rank:
        print(f"{prog}: rank {rank}: stopped, see rank {report.reporter}", file=sys.stderr)
        return
    if details is not None:
        details()
    print(f"{prog}: {'' if report.every_rank else f'rank {rank}: '}error: {message}", file=sys.stderr)


def _leave_launch(reported: bool) -> None:
    """End this process's part in a launcher's process group (or in one of one: FSDP); after an
    error report, once every rank has printed its part of it."""
    launched = _launch()[1] > 1
    if not launched and "torch.distributed" not in sys.modules:  # no process group without it: nothing to leave
        return
    from ..train.distributed import leave_after_report, leave_process_group

    if reported and launched:
        leave_after_report()
    else:
        leave_process_group()
