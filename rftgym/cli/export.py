"""``rftgym export``: a training run's model (LoRA merged) saved as a Hugging Face model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core.errors import ModelLoadError
from .common import UsageError, _check_model_dir


def cmd_export(args: argparse.Namespace) -> int:
    from ..train.export import export, is_run_dir

    if not is_run_dir(args.run):
        raise UsageError(f"{args.run!r} is not the output directory of an `rftgym train` run with a complete "
                         "checkpoint (checkpoint/state.json); give the --output-dir of a run")
    from ..agents.model_loading import check_trained_run

    try:  # a damaged checkpoint is the argument's fault, said before any model loads
        check_trained_run(Path(args.run).expanduser(), doing="export", otherwise="export another run")
    except ModelLoadError as exc:
        raise UsageError(str(exc)) from None
    if args.base_model is not None:
        _check_model_dir(args.base_model, "--base-model")
    out = export(args.run, args.out, base_model=args.base_model)
    print(f"the trained model of {args.run} is in {out}: rftgym eval ENV --agent hf --model {out}")
    return 0
