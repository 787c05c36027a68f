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

import contextvars
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ..core.devices import checked_device
from ..core.errors import ConfigError, ModelLoadError, TrainingError
from .base_model import base_fingerprint, files_fingerprint, kept_fingerprint_differs, load_dtype
from .checkpoint import apply_trainable, verify_checkpoint_file
from .run_dir import (
    CHECKPOINT_DIR,
    STAGING_PREFIX,
    checkpoint_path,
    is_checkpoint_folder,
    is_run_dir,
    kept_step,
    saved_state,
)
from .config import TrainConfig


def load_trained(run_dir: str | Path, *, device: str | None = None, base_model: str | Path | None = None):
    """The model and tokenizer of the run in ``run_dir``, as of its last checkpoint (or of an
    earlier one it keeps: ``run_dir/checkpoint-40``), with LoRA adapters merged: a plain
    transformers model in eval mode, every weight trainable. The base model is the one the run
    loaded (by the absolute path it kept, else its ``--model``), or ``base_model`` where it has
    moved since."""
    device = checked_device(device)  # before the model loads
    model, tokenizer, _, _ = _rebuild(Path(run_dir).expanduser(), base_model)
    model.to(device)
    return model, tokenizer


class BaseModelError(ModelLoadError):
    """The base model of a run cannot be loaded, or is not the one the run was trained from: what
    a --base-model (base_model=) given mends, unlike a damaged checkpoint."""


# The runs whose models are being rebuilt in this context, outermost first: a run's base model
# may be another run's directory, but a chain that comes back to a run would never end.
_REBUILDING: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar("rftgym_rebuilding", default=())


def _rebuild(run_dir: Path, base_model: str | Path | None, merge: bool = True):
    """(model, tokenizer, the checkpoint state of the weights read, the base model's source);
    ``merge=False``: a LoRA run's model as the peft model of its base and adapters (refused for a
    run that trained none)."""
    token = _REBUILDING.set((*_REBUILDING.get(), run_dir.resolve()))
    try:
        return _rebuild_once(run_dir, base_model, merge)
    finally:
        _REBUILDING.reset(token)


def _rebuild_once(run_dir: Path, base_model: str | Path | None, merge: bool = True):
    from ..agents.model_loading import load_model_and_tokenizer, names_default_model

    saved = _saved(run_dir)
    config = saved_config(run_dir, saved)
    # Where the run loaded its base (absolute), even when gone: the message then names that place.
    source = base_model or saved.get("base_model_path") or config.model
    if saved.get("base_model_in_memory") is True and not base_model:
        raise BaseModelError(f"the run in {run_dir} trained a policy passed in from memory (train(policy=...), loaded "
                             "from no directory and with no model named), so it cannot load its base weights itself: "
                             "save them (the untrained model and its tokenizer, save_pretrained(DIR)) and name that "
                             "directory: load_trained(RUN, base_model=DIR) (rftgym export RUN OUT --base-model DIR)")
    named = "as the default model" if names_default_model(source) else f"from {source}"
    _refuse_a_loop(run_dir, source)
    if not merge and not config.lora_rank:
        raise ConfigError(f"the run in {run_dir} trained the whole model (lora_rank 0), so it has no adapters to "
                          "export on their own; export the model without --adapter-only (adapter_only=False)")
    model_name = None if source is None else str(source)
    dtype = load_dtype(config)  # the dtype the run trained it in: its update was made on those weights
    # Before the load (minutes for a large model), where the run's own base model's files gave its
    # fingerprint (its state's base_model_from_files): the same reading cannot refuse the right model.
    if saved.get("base_model_from_files") is True:
        _check_base_weights(saved, files_fingerprint(model_name, dtype), run_dir, named)
    try:
        model, tokenizer = load_model_and_tokenizer(model_name, device="cpu", dtype=dtype)
    except ModelLoadError as exc:
        raise BaseModelError(f"the base model of the run in {run_dir} cannot be loaded {named}: {exc} If it has "
                             "moved, name its directory: rftgym export RUN OUT --base-model DIR "
                             "(load_trained(..., base_model=DIR))") from None
    _check_base_weights(saved, base_fingerprint(model), run_dir, named)
    if config.lora_rank:
        from .model_setup import with_lora

        # Merged in float32: a small update added to 16-bit weights would be rounded away.
        model = with_lora(model.float(), config)
    weights, folder, saved = _read_weights(run_dir, saved)
    try:
        apply_trainable(weights, model, folder)
    except ValueError as exc:
        raise ModelLoadError(f"{exc} (was the run's model or LoRA setting changed by hand?)") from None
    if config.lora_rank and merge:
        model = model.merge_and_unload()
        model.requires_grad_(True)  # LoRA froze the base weights; the merged model is a whole model again
    model.eval()
    return model, tokenizer, saved, source


def _check_base_weights(saved: dict, found: str | None, run_dir: Path, named: str) -> None:
    """Refuse base weights whose fingerprint ``found`` (None: unknown, not checked) is not the one
    the run kept (a run saved before fingerprints were kept is not checked)."""
    if kept_fingerprint_differs(saved, found):
        raise BaseModelError(f"the weights loaded {named} are not the base weights the run in {run_dir} was trained "
                             f"from (fingerprint {found}, the run's {saved['base_model']}); name the directory of the "
                             "model it was trained from: rftgym export RUN OUT --base-model DIR (load_trained(..., "
                             "base_model=DIR))")


def _refuse_a_loop(run_dir: Path, source) -> None:
    """A base model that is a run being rebuilt already (the run itself, when it was trained with
    its --output-dir in its model's directory) would be rebuilt without end."""
    if source in (None, "default") or not is_run_dir(source):
        return
    chain = _REBUILDING.get()
    base = Path(source).expanduser().resolve()
    if base in chain:
        loop = " -> ".join(str(p) for p in (*chain[chain.index(base):], base))
        raise ModelLoadError(f"the run in {run_dir} is its own base model ({loop}): it was trained with its "
                             "--output-dir in the directory of the model it trained from, which now reads as the run. "
                             "Move the run's files (checkpoint/, metrics.jsonl, tensorboard/, learning_curve.png) "
                             "into a directory of their own; the model's files are as they were")


def saved_config(run_dir: Path, saved: dict) -> TrainConfig:
    """The run's settings from its checkpoint state ``saved``, or a ModelLoadError naming the file
    (not a bare refusal of a setting the user never gave: a state.json edited by hand)."""
    try:
        return TrainConfig.from_saved(saved["config"])
    except (ConfigError, TypeError) as exc:
        raise ModelLoadError(f"the settings saved with the checkpoint in {run_dir} (the 'config' of "
                             f"checkpoint/state.json) are refused: {exc}. The checkpoint is left as it is; mend "
                             "state.json") from None


def _saved(run_dir: Path) -> dict:
    try:
        return saved_state(run_dir, doing="read")
    except ConfigError as exc:
        raise ModelLoadError(str(exc)) from None


def _read_weights(run_dir: Path, state: dict | None = None) -> tuple[dict, Path, dict]:
    """The trained weights of the run's checkpoint, the folder and the state (``state``: as last
    read, read here when not given) they are from, read whole from one checkpoint even while the
    run is still writing new ones (a save replaces the folder meanwhile, and the step: read again)."""
    if state is None:
        state = _saved(run_dir)
    for _ in range(5):
        folder = checkpoint_path(run_dir)
        weights, failure = None, None
        try:
            if folder is None:
                raise FileNotFoundError(run_dir / CHECKPOINT_DIR)
            verify_checkpoint_file(folder, "trainable.pt", state)
            weights = torch.load(folder / "trainable.pt", map_location="cpu")
        except MemoryError:
            raise
        except Exception as exc:  # torch.load raises many types
            failure = exc
        now = _saved(run_dir)
        if now["step"] != state["step"]:  # replaced while read: read the new one
            state = now
            continue
        if failure is None:
            return weights, folder, state
        if folder is not None:
            raise _unreadable_weights(folder / "trainable.pt", failure)
    raise ModelLoadError(f"the run in {run_dir} kept replacing its checkpoint while it was read; try again, or "
                         "wait for the run to end")


def _unreadable_weights(path: Path, exc: Exception) -> ModelLoadError:
    """Why the trained weights in ``path`` (not replaced while read) cannot be loaded."""
    if isinstance(exc, ConfigError):  # not the file its save wrote (verify_checkpoint_file)
        return ModelLoadError(str(exc))
    if isinstance(exc, FileNotFoundError):
        return ModelLoadError(f"{path.parent} holds no trainable.pt (the trained weights); the checkpoint is "
                              "incomplete")
    if isinstance(exc, PermissionError):  # (torch.load reports a file cut short with other OSErrors)
        return ModelLoadError(f"cannot read {path} (the run's trained weights): {exc.strerror or exc}; make it "
                              "readable, or give another model directory")
    said = str(exc).split(". ")[0].splitlines()[0] if str(exc) else ""
    return ModelLoadError(f"{path} is damaged: torch cannot load it as the run's trained weights "
                          f"({type(exc).__name__}: {said}). The checkpoint is left as it is; restore the file from a "
                          "copy, or give another model directory")


def _check_out_dir(run_dir: Path, out_dir: Path) -> Path:
    """``out_dir`` as an absolute path where a model may be written, or a ConfigError saying why
    not (before any model loads)."""
    out = out_dir.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out_dir} is a file; the model is written to a directory: choose a new one")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out_dir} is a directory that is not empty; choose a new one")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{out_dir} cannot be made: {existing} is a file")
    run = run_dir.expanduser().resolve()
    if is_checkpoint_folder(run):  # (RUN/checkpoint-40, RUN/checkpoint: the run's own directory is its parent)
        run = run.parent
    if out.is_relative_to(run) and out != run:
        first = out.relative_to(run).parts[0]
        if first == CHECKPOINT_DIR or first.startswith(STAGING_PREFIX) or kept_step(Path(first)) is not None:
            raise ConfigError(f"{out_dir} is inside the run's checkpoint area, which its next save replaces; "
                              f"choose another directory (e.g. {run / 'model'})")
    if out == run or out == out.parent:
        raise ConfigError(f"{out_dir} is the run's own directory or a root; choose a new directory")
    return out


EXPORT_STAGING_PREFIX = ".rftgym-export."  # the folder an export writes before it takes its name


def export(run_dir: str | Path, out_dir: str | Path, *, base_model: str | Path | None = None,
           adapter_only: bool = False) -> Path:
    """Save the run's trained model (LoRA merged) and its tokenizer in ``out_dir``, a new (or
    empty) directory, with ``rftgym_run.json`` saying which run, step and base model it holds.
    ``adapter_only``: a LoRA run's adapters alone, as peft saves them (``adapter_config.json``
    naming the base model's directory, ``adapter_model.safetensors``), for
    ``PeftModel.from_pretrained(base, out_dir)`` or a server that applies adapters to its base
    (vLLM's ``--lora-modules``)."""
    from ..agents.model_loading import default_model_dir, names_default_model

    run_dir = Path(run_dir).expanduser()
    out = _check_out_dir(run_dir, Path(out_dir))
    model, tokenizer, saved, source = _rebuild(run_dir, base_model, merge=not adapter_only)
    base = "default" if names_default_model(source) else str(Path(source).expanduser().resolve())
    if adapter_only:
        if base != "default" and is_run_dir(base):
            raise ConfigError(f"the base model of the run in {run_dir} is another run ({base}), whose trained weights "
                              "no model directory holds, so its adapters would name a base no loader can read; export "
                              f"that run first (rftgym export {base} DIR) and name it: --base-model DIR "
                              "(base_model=DIR)")
        # Where a loader finds the base: its directory (the default model's, where its weights are kept).
        base = str(default_model_dir()) if base == "default" else base
        for adapter in model.peft_config.values():
            adapter.base_model_name_or_path = base
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Written beside it and renamed, so that an interrupted export leaves no half model behind; under
        # a name of the export's own (".checkpoint-…" is a run's staging, which its next save clears
        # away when the export goes into the run's directory).
        staging = Path(tempfile.mkdtemp(prefix=f"{EXPORT_STAGING_PREFIX}{out.name}.", dir=out.parent))
    except OSError as exc:
        raise _cannot_export(out, exc) from exc
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "rftgym_run.json").write_text(json.dumps(
            {"run": str(run_dir.resolve()), "step": saved["step"], "env_id": saved["config"].get("env_id"),
             "algo": saved["config"].get("algo"), "base_model": base, "adapter_only": adapter_only},
            indent=2))
        # For any reader (a model server running as another user): save_pretrained may write 0600.
        for path in staging.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        staging.chmod(0o755)
        written = "adapter_config.json" if adapter_only else "config.json"
        if not (staging / written).is_file() or not any(staging.glob("*.safetensors")):
            raise TrainingError(f"the export's files in {staging} went missing while it wrote them (another "
                                f"program removed them?); nothing was exported to {out}: run the export again")
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except OSError as exc:  # a full disk, a quota, a folder it may not write
        raise _cannot_export(out, exc) from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out


def _cannot_export(out: Path, exc: OSError) -> TrainingError:
    try:
        free = f"; {shutil.disk_usage(out.parent).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = ""
    return TrainingError(f"cannot write the export in {out.parent} ({exc.strerror or exc}{free}); nothing was "
                         f"exported to {out}, and the run is left as it is. Free space (or export elsewhere), then "
                         "run the export again")
