"""The base model's fingerprint: a resume (and an export) must build on the weights a run
started from, wherever they have moved. :func:`base_fingerprint` reads it from the loaded model,
:func:`files_fingerprint` from the model's safetensors files before it loads, so that a resume on
other weights can be refused at once."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch

from .distributed import inner_model


FINGERPRINT_SAMPLES = 256  # weights sampled from each parameter


def _stride(numel: int) -> int:
    return max(1, numel // FINGERPRINT_SAMPLES)


def _fingerprint(samples, rounded: torch.dtype = torch.bfloat16) -> str:
    """The fingerprint of ``samples``: (name, shape, sampled weights in the dtype they load in),
    sorted by name; the weights are read as ``rounded`` (float32: as they are)."""
    digest = hashlib.sha256()
    for name, shape, sample in samples:
        digest.update(f"{name}{shape}".encode())
        digest.update(sample.to("cpu", rounded).float().numpy().tobytes())
    return digest.hexdigest()[:16]


def _samples(model):
    return ((name, tuple(parameter.shape),
             parameter.detach().reshape(-1)[:: _stride(parameter.numel())][:FINGERPRINT_SAMPLES])
            for name, parameter in sorted(inner_model(model).named_parameters()))


def weights_fingerprint(model) -> str:
    """A fingerprint of ``model``'s weights as they are now, unrounded: a step of training
    changes it (an evaluation resumed on other weights than it began with is refused by it)."""
    with torch.no_grad():
        return _fingerprint(_samples(model), rounded=torch.float32)


def base_fingerprint(model) -> str:
    """A fingerprint of ``model``'s weights as loaded, before any training: a resume must start
    from the same base model (LoRA adapters sit on its frozen weights, and a KL reference is that
    model), while its path may have moved. A strided sample of each parameter, rounded to
    bfloat16 so that loading the same weights in float32 or bfloat16 gives the same print
    (:func:`files_fingerprint` reads the same one from the model's files, before it loads)."""
    with torch.no_grad():
        return _fingerprint(_samples(model))


def files_fingerprint(model: str | None, dtype: str) -> str | None:
    """:func:`base_fingerprint` of the model that ``--model model`` loads in ``dtype``, read from
    its safetensors files before it loads (which takes minutes for a large model), so that a
    resume on other weights is refused at once. The parameters' names and shapes are the model's
    own, built from its config.json on the meta device (no weights); their samples come from the
    files. None where the files cannot say it, and the check after the load decides alone: a
    training run's directory (its trained weights are merged in as it loads), quantized weights,
    another format, a parameter the files lack (it would be initialised at random) or hold in
    another shape, or anything that cannot be read."""
    try:
        return _files_fingerprint(model, getattr(torch, dtype))
    except Exception:  # whatever it was, the load says it, or finds the model fine
        return None


def _files_fingerprint(model: str | None, dtype: torch.dtype) -> str | None:
    import transformers

    from ..agents.model_loading import resolve_model_dir
    from .run_dir import is_run_dir

    folder = resolve_model_dir(model)
    if is_run_dir(folder):
        return None
    settings = transformers.AutoConfig.from_pretrained(folder)
    if getattr(settings, "quantization_config", None) is not None:
        return None
    stored = _safetensors_entries(folder)
    if stored is None:
        return None
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(settings)
    samples = []
    for name, parameter in sorted(skeleton.named_parameters()):
        entry = stored.get(name)
        if entry is None or tuple(entry["shape"]) != tuple(parameter.shape):
            return None
        samples.append((name, tuple(parameter.shape), _stored_sample(entry).to(dtype)))
    return _fingerprint(samples)


# The dtypes a base model's weights are stored in (others: no fingerprint from the files).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _safetensors_entries(folder: Path) -> dict[str, dict] | None:
    """Each tensor of the safetensors file(s) that transformers loads from ``folder`` (one file,
    else the shards its index names): its header entry, with the file and where its data starts."""
    if (folder / "model.safetensors").is_file():  # transformers' own order of preference
        files = [folder / "model.safetensors"]
    elif (folder / "model.safetensors.index.json").is_file():
        index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
        files = [folder / name for name in sorted(set(index["weight_map"].values()))]
    else:
        return None
    entries = {}
    for file in files:
        # Memory-mapped: only the pages read are read (8 bytes of header length, the JSON header,
        # then the samples), not the whole file.
        mapped = np.memmap(file, dtype=np.uint8, mode="r")
        length = int.from_bytes(mapped[:8].tobytes(), "little")
        header = json.loads(mapped[8:8 + length].tobytes())
        header.pop("__metadata__", None)
        for name, entry in header.items():
            entries[name] = {**entry, "mapped": mapped, "data_start": 8 + length}
    return entries


def _stored_sample(entry: dict) -> torch.Tensor:
    """The weights :func:`base_fingerprint` samples, read from a tensor's safetensors entry."""
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    numel, size = math.prod(entry["shape"]), dtype.itemsize
    begin, end = entry["data_offsets"]
    if end - begin != numel * size:
        raise ValueError(f"a tensor of {end - begin} bytes for {numel} weights")
    step = _stride(numel)
    count = min(FINGERPRINT_SAMPLES, -(-numel // step))
    bits = np.ndarray((count,), dtype=f"<i{size}", buffer=entry["mapped"], offset=entry["data_start"] + begin,
                      strides=(step * size,))
    return torch.from_numpy(bits.copy()).view(dtype)


def load_dtype(config) -> str:
    """The dtype a run's base model loads in (a TrainConfig's dtype, else float32: on CUDA the
    master weights of mixed precision, elsewhere full precision); its fingerprint is read in it,
    and an export rebuilds the model in it, as the run's update was made on those weights."""
    return config.dtype or "float32"


def kept_fingerprint_differs(saved: dict, found: str | None) -> bool:
    """Whether the base-weight fingerprint a checkpoint kept (``saved``: its state) is not ``found``
    (None: unknown; a checkpoint written before fingerprints were kept has none: not compared)."""
    expected = saved.get("base_model")
    return found is not None and isinstance(expected, str) and expected != found
