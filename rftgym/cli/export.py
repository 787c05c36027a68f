"""``rftgym export``: a training run's model (LoRA merged) saved as a Hugging Face model directory."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from ..core.errors import ModelLoadError
from .common import UsageError, _check_model_dir


def cmd_export(args: argparse.Namespace) -> int:
    from ..train.export import BaseModelError, export
    from ..train.run_dir import is_run_dir

    if not Path(args.run).expanduser().exists():
        raise UsageError(f"{args.run!r} does not exist; give the --output-dir of an `rftgym train` run")
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
    _check_out_can_be_made(args.out)
    try:
        out = export(args.run, args.out, base_model=args.base_model, adapter_only=args.adapter_only)
    except BaseModelError as exc:  # the base model given is not the run's (or cannot load): the argument's fault
        if args.base_model is None:
            raise
        raise UsageError(f"--base-model: {exc}") from None
    if args.adapter_only:
        print(f"the LoRA adapters of {args.run} are in {out}: PeftModel.from_pretrained(base_model, {str(out)!r}), or "
              f"vllm serve BASE --enable-lora --lora-modules NAME={out}")
    else:
        print(f"the trained model of {args.run} is in {out}: rftgym eval ENV --agent hf --model {out}")
    return 0


def _check_out_can_be_made(out: str) -> None:
    """Refuse an OUT in a place that cannot be written (read-only, or /proc), before the model
    loads: the export writes the model into a folder made beside OUT, and would otherwise fail there
    with a traceback. The folder is made and removed here, as a test (an OUT in the way of a file,
    or not empty, is refused by the export itself, with its own message)."""
    folder = Path(out).expanduser().absolute().parent
    while not folder.exists():  # the export makes the folders missing below it
        folder = folder.parent
    if not folder.is_dir():
        return
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rftgym-export-check-", dir=folder))
    except OSError as exc:
        raise UsageError(f"{out} cannot be made: {folder} cannot be written ({exc.strerror or exc}); give a new "
                         "directory in a place you can write") from None
