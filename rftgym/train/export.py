"""The model a training run made, as a plain Hugging Face model.

A run's checkpoint holds what it trained: every weight, or LoRA adapters over frozen base weights.
:func:`load_trained` rebuilds the trained model from it (the base model named in the run's
config, checked against the fingerprint the run kept; LoRA adapters merged into the base
weights), so that ``rftgym eval --agent hf --model RUN_DIR`` evaluates it, and :func:`export`
saves it with its tokenizer as a model directory any tool loads (transformers, vLLM,
``rftgym eval``)::

    rftgym export runs/grpo runs/grpo-model
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from ..core.errors import ConfigError, ModelLoadError, require
from .checkpoint import CHECKPOINT_DIR, OLD_CHECKPOINT_DIR, base_fingerprint, has_checkpoint, saved_state
from .config import TrainConfig


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is a training run's output directory holding a complete checkpoint."""
    path = Path(path).expanduser()
    return path.is_dir() and has_checkpoint(path)


def load_trained(run_dir: str | Path, *, device: str | None = None, base_model: str | Path | None = None):
    """The model and tokenizer of the run in ``run_dir``, as of its last checkpoint, with LoRA
    adapters merged: a plain transformers model in eval mode. The base model is the one the run
    loaded (by the absolute path it kept, else its ``--model``), or ``base_model`` where it has
    moved since."""
    from ..agents.model_loading import load_model_and_tokenizer

    run_dir = Path(run_dir).expanduser()
    saved = saved_state(run_dir)
    config = TrainConfig.from_dict({k: v for k, v in saved["config"].items() if k in TrainConfig.__dataclass_fields__})
    source = base_model or saved.get("base_model_path") or config.model
    try:
        model, tokenizer = load_model_and_tokenizer(None if source is None else str(source), device="cpu",
                                                    dtype=config.dtype or "float32")
    except ModelLoadError as exc:
        raise ModelLoadError(f"the base model of the run in {run_dir} (--model {config.model or 'default'}) cannot be "
                             f"loaded from {source or 'default'}: {exc} If it has moved, name its directory: rftgym "
                             "export RUN OUT --base-model DIR (load_trained(..., base_model=DIR))") from None
    expected, found = saved.get("base_model"), base_fingerprint(model)
    if isinstance(expected, str) and expected != found:
        raise ModelLoadError(f"the run in {run_dir} was trained from --model {config.model or 'default'}, whose "
                             f"weights have changed since (fingerprint {found}, the run's {expected}); its trained "
                             "weights cannot be rebuilt on them")
    if config.lora_rank:
        peft = require("peft", "train", "Rebuilding a LoRA run's model")
        model = peft.get_peft_model(model, peft.LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha,
                                                           target_modules="all-linear", lora_dropout=0.0,
                                                           task_type="CAUSAL_LM"))
    _load_weights(run_dir, model)
    if config.lora_rank:
        model = model.merge_and_unload()
    model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.eval()
    return model, tokenizer


def _read_weights(run_dir: Path) -> tuple[dict, Path]:
    """The trained weights of the run's checkpoint, read whole from one checkpoint even while the
    run is still writing new ones (a save replaces the folder between the reads: read again)."""
    for _ in range(5):
        step = saved_state(run_dir)["step"]
        folder = next(run_dir / name for name in (CHECKPOINT_DIR, OLD_CHECKPOINT_DIR)
                      if (run_dir / name / "state.json").is_file())
        try:
            weights = torch.load(folder / "trainable.pt", map_location="cpu")
        except FileNotFoundError:
            continue  # replaced while read
        except Exception as exc:  # torch.load raises many types
            raise ModelLoadError(f"cannot read {folder / 'trainable.pt'} ({type(exc).__name__}: {exc})") from exc
        if saved_state(run_dir)["step"] == step:
            return weights, folder
    raise ModelLoadError(f"the run in {run_dir} kept replacing its checkpoint while it was read; try again, or "
                         "wait for the run to end")


def _load_weights(run_dir: Path, model) -> None:
    weights, folder = _read_weights(run_dir)
    params = dict(model.named_parameters())
    unknown = [name for name in weights if name not in params]
    if unknown or not weights:
        raise ModelLoadError(f"{folder / 'trainable.pt'} does not fit the model its run names ({len(unknown)} unknown "
                             f"weights, e.g. {unknown[:2]}); was the run's model or LoRA setting changed by hand?")
    with torch.no_grad():
        for name, tensor in weights.items():
            if tensor.shape != params[name].shape:
                raise ModelLoadError(f"{folder / 'trainable.pt'}: {name} has shape {tuple(tensor.shape)}, the model's "
                                     f"{tuple(params[name].shape)}")
            params[name].copy_(tensor.to(params[name].dtype))


def export(run_dir: str | Path, out_dir: str | Path, *, base_model: str | Path | None = None) -> Path:
    """Save the run's trained model (LoRA merged) and its tokenizer in ``out_dir``, a new
    directory, with ``rftgym_run.json`` saying which run and step it holds."""
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ConfigError(f"{out_dir} exists and is not an empty directory; choose a new one")
    model, tokenizer = load_trained(run_dir, device="cpu", base_model=base_model)
    saved = saved_state(Path(run_dir).expanduser())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Written beside it and renamed, so that an interrupted export leaves no half model behind.
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "rftgym_run.json").write_text(json.dumps(
            {"run": str(Path(run_dir).expanduser().resolve()), "step": saved["step"],
             "env_id": saved["config"].get("env_id"), "algo": saved["config"].get("algo"),
             "base_model": saved["config"].get("model")}, indent=2))
        staging.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir
