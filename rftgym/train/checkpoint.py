"""Checkpoints that make a resumed run continue exactly where it stopped.

A checkpoint holds the trainable weights (all of them, or only the LoRA adapters), the
optimizer state, the step, and every random state the loop draws from (task seeds, sampling,
segment sampling), written to a temporary directory and renamed into place so that a crash never
leaves half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_DIR = "checkpoint"


def trainable_state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(output_dir: Path, *, model, optimizer, step: int, rng_states: dict[str, Any], config: dict) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=output_dir))
    try:
        torch.save(trainable_state(model), staging / "trainable.pt")
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(rng_states, staging / "rng.pt")
        (staging / "state.json").write_text(json.dumps({"step": step, "config": config}, indent=2, default=str))
        target = output_dir / CHECKPOINT_DIR
        if target.exists():
            old = output_dir / ".checkpoint-old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
        return target
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _checkpoint_path(output_dir: Path) -> Path | None:
    # A crash between the two renames of a save leaves only the previous checkpoint, under its
    # temporary name: it is still a complete checkpoint.
    for name in (CHECKPOINT_DIR, ".checkpoint-old"):
        if (output_dir / name / "state.json").is_file():
            return output_dir / name
    return None


def has_checkpoint(output_dir: Path) -> bool:
    return _checkpoint_path(output_dir) is not None


def load_checkpoint(output_dir: Path, *, model, optimizer) -> tuple[int, dict[str, Any], dict]:
    """Restore weights and optimizer in place; return (step, rng states, saved config)."""
    path = _checkpoint_path(output_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {output_dir}")
    state = json.loads((path / "state.json").read_text())
    weights = torch.load(path / "trainable.pt", map_location="cpu")
    params = dict(model.named_parameters())
    missing = [name for name in weights if name not in params]
    if missing:
        raise ValueError(f"checkpoint in {path} does not match the model (unknown parameters {missing[:3]}…); "
                         "resume with the same model and LoRA settings")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu"))
    rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=False)
    return int(state["step"]), rng, state["config"]
