"""The line every benchmark prints first (what was measured, when and where, so that a saved
table says which commit and machine gave its numbers), and the argument checks they share."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The checkout's commit, marked where files differ from it (the numbers are then not that
    commit's alone)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=ROOT).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"{head or 'unknown commit'}{' with uncommitted changes' if changed else ''}"


def provenance_line() -> str:
    """``# rftgym <commit> · <UTC time> · <CPUs>, load <1-min average> · <GPU or no GPU> · torch <version>``."""
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
        torch_version = f"torch {torch.__version__}"
    except ImportError:
        gpu, torch_version = "no torch", ""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"rftgym {commit()}", when, f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", gpu, torch_version]
    return "# " + " · ".join(p for p in parts if p)


def check_device(parser, device: str) -> None:
    """Refuse ``--device`` where torch cannot run here (``--device cuda`` on a machine without
    CUDA), as the parser's own error, before anything is measured."""
    from rftgym.core.devices import device_problem

    problem = device_problem(device)
    if problem is not None:
        parser.error(f"--device {device}: {problem}")


def check_positive(parser, args, *names: str) -> None:
    """Refuse each of ``names`` (argparse dests; an int or a list of them) that is below 1, as the
    parser's own error, before anything loads or runs."""
    for name in names:
        value = getattr(args, name)
        if value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if item < 1:
                parser.error(f"--{name.replace('_', '-')} must be at least 1, got {item}")
