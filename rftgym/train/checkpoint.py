"""Checkpoints that make a resumed run continue exactly where it stopped.

A checkpoint holds the trainable weights (all of them, or only the LoRA adapters), the
optimizer state, the step, and every random state the loop draws from (task seeds, sampling,
segment sampling), written to a temporary directory, synced to disk and renamed into place so
that a crash never leaves half a checkpoint, with each file's sha256 in ``state.json`` so that a
file damaged later is refused instead of trained on. The checkpoint a save replaces is removed, or
kept as ``checkpoint-<step>/`` when the run keeps earlier ones (``keep_checkpoints``).
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

from ..agents.model_loading import names_default_model
from ..core.errors import ConfigError, TrainingError, warn_caller
from ..core.values import is_int
from ..envs.common import same_env_id
from .base_model import kept_fingerprint_differs
from .config import RESUME_FIXED, RESUME_FREE, TrainConfig, _default
from .distributed import Distributed, full_tensor, inner_model, shard_like
from .master_weights import MasterWeights
from .run_dir import (
    CHECKPOINT_DIR,
    KEPT_MARKER,
    KEPT_PREFIX,
    OLD_CHECKPOINT_DIR,
    STAGING_PREFIX,
    check_state,
    checkpoint_path,
    how_to_continue,
    kept_checkpoints,
)
from .schedule import learning_rate_at
from .stopping import held_stops


def _whole(tensor: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    # One tensor at a time, straight to CPU: a sharded optimizer state never exists whole on a GPU.
    whole = full_tensor(tensor.detach())
    return whole.cpu().clone() if keep else None


def trainable_state(model, keep: bool = True) -> dict[str, torch.Tensor]:
    """The trainable weights, whole, on CPU (a collective when sharded; ``keep=False`` on ranks
    that only take part in the gathering)."""
    return {name: _whole(p, keep) for name, p in inner_model(model).named_parameters() if p.requires_grad}


def optimizer_state(optimizer, keep: bool = True) -> dict:
    state = optimizer.state_dict()
    state["state"] = {index: {key: _whole(value, keep) if isinstance(value, torch.Tensor) else value
                              for key, value in entry.items()} for index, entry in state["state"].items()}
    return state


def checkpoint_state(model, optimizer, keep: bool = True) -> dict[str, Any]:
    """What :func:`save_checkpoint` writes of the model and optimizer. With FSDP every rank must
    call it (the shards are gathered); only the writing rank needs ``keep=True``."""
    return {"weights": trainable_state(model, keep), "optimizer": optimizer_state(optimizer, keep)}


def check_base_model(saved: dict, fingerprint: str, config: TrainConfig) -> None:
    """Refuse to resume a checkpoint (``saved``: its state) on other base weights than it was
    trained from; a checkpoint written before fingerprints were kept is not checked."""
    if kept_fingerprint_differs(saved, fingerprint) and saved.get("base_model_in_memory") is True:
        raise ConfigError(f"the checkpoint in {config.output_dir} was trained from a policy passed in from memory "
                          "(train(policy=...), loaded from no directory and with no model named), and these base "
                          f"weights (fingerprint {fingerprint}; the run's {saved['base_model']}) are not that "
                          "policy's. Resume with the same policy (train(config, policy=..., resume=True)), or with "
                          "model= naming a directory its base weights were saved in")
    if kept_fingerprint_differs(saved, fingerprint):
        raise ConfigError(f"the checkpoint in {config.output_dir} was trained from other base weights than "
                          f"--model {config.model or 'default'} holds (fingerprint {saved['base_model']}, this model's "
                          f"{fingerprint}; it was trained from --model {saved['config'].get('model') or 'default'}). "
                          "Resume with the model it was trained from, or start a new run in another output directory")


def check_base_model_early(saved: dict, from_files: str | None, config: TrainConfig) -> None:
    """:func:`check_base_model` before the model loads, on ``from_files`` (this model's
    :func:`.base_model.files_fingerprint`), where the checkpoint's own model's files gave its fingerprint (its
    state's ``base_model_from_files``): the same reading of the files cannot then refuse the model
    that wrote it. Elsewhere the check after the load decides alone."""
    if from_files is not None and saved.get("base_model_from_files") is True:
        check_base_model(saved, from_files, config)


def _stops_deferred():
    """Hold Ctrl-C and SIGTERM until the block is done, then stop as they would have: an interrupt
    raised inside torch.save's writer comes out as a RuntimeError, which a save cannot tell from a
    full disk, and the checkpoint being written (seconds) is worth finishing."""
    return held_stops("rftgym: finishing the checkpoint being written, then stopping", second_stops_now=False)


def save_checkpoint(output_dir: Path, *, state: dict[str, Any], step: int, rng_states: dict[str, Any],
                    config: dict, base_model: str | None = None, base_model_path: str | None = None,
                    base_model_from_files: bool = False, env_from_caller: bool = False, keep: int = 1,
                    unlogged_metrics: list[dict] | None = None, env_module_file: str | None = None,
                    base_model_in_memory: bool = False) -> Path:
    """Write ``state`` (from :func:`checkpoint_state`), the step, the random states, the config,
    the base model's fingerprint (:func:`.base_model.base_fingerprint`), whether its files gave the same one
    before it loaded (:func:`.base_model.files_fingerprint`; a resume is then checked before its model loads)
    and the absolute path it was loaded from (None for the default model, or a policy passed in that
    was not loaded from a directory: ``base_model_in_memory``, where no --model named it either),
    which --model may have given as a relative one; and whether
    the caller made the env (``train(make_env=...)``: a resume must be given it again). ``keep``:
    how many checkpoints the run keeps, this one included (0: every one); the one this replaces
    is kept as ``checkpoint-<its step>/`` while there is room. Ctrl-C or SIGTERM meanwhile stops
    the run once the checkpoint is whole. ``unlogged_metrics``: the metrics rows of the steps done
    since the last row metrics.jsonl has (``--log-every`` above 1), which a resumed run's first row
    stands for too. ``env_module_file``: the file of the module a ``module:EnvId`` env came from,
    so that a resume that cannot import it can say where it was."""
    with _stops_deferred():
        return _save_checkpoint(output_dir, state=state, step=step, rng_states=rng_states, config=config,
                                base_model=base_model, base_model_path=base_model_path,
                                base_model_from_files=base_model_from_files, env_from_caller=env_from_caller,
                                env_module_file=env_module_file, base_model_in_memory=base_model_in_memory,
                                keep=keep, unlogged_metrics=unlogged_metrics or [])


def _save_checkpoint(output_dir: Path, *, state: dict[str, Any], step: int, rng_states: dict[str, Any],
                     config: dict, base_model: str | None, base_model_path: str | None,
                     base_model_from_files: bool, env_from_caller: bool, keep: int,
                     unlogged_metrics: list[dict], env_module_file: str | None = None,
                     base_model_in_memory: bool = False) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    # The run holds the output directory's lock, so any other staging folder is what a killed run
    # left half-written: it is removed (OLD_CHECKPOINT_DIR is not one; it may be the last whole one).
    for stale in output_dir.glob(f"{STAGING_PREFIX}*"):
        if stale.name != OLD_CHECKPOINT_DIR and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir))
    staging.chmod(0o755)  # mkdtemp's 0700 would keep the checkpoint from the run's other readers
    try:
        try:
            files = {name: _save_hashed(value, staging / name) for name, value in
                     (("trainable.pt", state["weights"]), ("optimizer.pt", state["optimizer"]), ("rng.pt", rng_states))}
            with open(staging / "state.json", "w", encoding="utf-8") as handle:
                json.dump({"step": step, "config": config, "base_model": base_model,
                           "base_model_from_files": base_model_from_files, "base_model_path": base_model_path,
                           "env_from_caller": env_from_caller,
                           **({"base_model_in_memory": True} if base_model_in_memory else {}),
                           **({"env_module_file": env_module_file} if env_module_file else {}),
                           **({"unlogged_metrics": unlogged_metrics} if unlogged_metrics else {}),
                           "files": files}, handle, indent=2, default=str)
                handle.flush()
                _fsync(handle.fileno())
            _fsync_dir(staging)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
            free = shutil.disk_usage(output_dir).free
            raise TrainingError(f"cannot write the checkpoint of step {step} in {output_dir} ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''}; {free / 2**20:,.0f} MiB free "
                                f"there); the previous checkpoint, if any, is kept. Free space, "
                                f"{how_to_continue(output_dir)}") from exc
        target = output_dir / CHECKPOINT_DIR
        old = output_dir / OLD_CHECKPOINT_DIR
        if target.exists():
            _retire(old, keep, step)  # one a crash left there after a save's renames: an earlier one
            os.replace(target, old)
        # (else old, if there, is the last whole checkpoint: a crash came between these renames)
        os.replace(staging, target)
        _retire(old, keep, step)
        _drop_surplus(output_dir, keep, step)
        _fsync_dir(output_dir)  # the renames themselves, so that a power loss keeps one whole checkpoint
        return target
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _retire(previous: Path, keep: int, saved_step: int) -> None:
    """Keep the checkpoint a save (of step ``saved_step``) replaced, ``previous``, as
    ``checkpoint-<its step>/`` when the run keeps earlier ones, else remove it. Keeping it is
    housekeeping: where it cannot be kept (a folder of that name that is not one this run kept,
    a rename that fails) it is removed, with a warning, and the run goes on."""
    if not previous.exists():
        return
    try:
        step = json.loads((previous / "state.json").read_text())["step"] if keep != 1 else None
    except (OSError, ValueError, TypeError, KeyError):
        step = None  # not a whole checkpoint (nothing to keep)
    if not is_int(step) or not 0 <= step < saved_step:
        shutil.rmtree(previous, ignore_errors=True)
        return
    kept = previous.parent / f"{KEPT_PREFIX}{step}"
    try:
        if os.path.lexists(kept):
            if not kept_by_the_run(kept):
                raise FileExistsError(errno.EEXIST, "a file or folder of that name, not one the run kept, is there")
            _discard(kept)  # this run's at that step, kept before a resume from an earlier checkpoint
        # The marker names the folder by its inode, which a rename keeps and a copy (cp -r, which
        # copies the marker too) does not: a copy is never the run's to remove.
        (previous / KEPT_MARKER).write_text(str(previous.stat().st_ino))
        os.replace(previous, kept)
    except OSError as exc:
        warn_caller(f"the checkpoint of step {step} cannot be kept as {kept} ({exc.strerror or exc}); it is removed")
        shutil.rmtree(previous, ignore_errors=True)


def _drop_surplus(output_dir: Path, keep: int, step: int) -> None:
    """Remove the oldest earlier checkpoints this run kept (those marked so: never a copy or another
    tool's folder) past the ``keep - 1`` it keeps beside its last one, of step ``step`` (0: keep
    every one)."""
    if keep == 0:
        return
    earlier = [folder for number, folder in kept_checkpoints(output_dir).items()
               if number < step and kept_by_the_run(folder)]
    for folder in earlier[:max(len(earlier) - (keep - 1), 0)]:
        _discard(folder)


def kept_by_the_run(folder: Path) -> bool:
    """Whether the run kept ``folder`` itself (its marker names this very folder), so that it may
    remove it: not a copy of one, nor another tool's folder of that name."""
    try:
        marker = (folder / KEPT_MARKER).read_text().strip()
        # An empty marker is an earlier version's (before copies were told apart): the run's.
        return marker in ("", str(folder.stat().st_ino))
    except (OSError, UnicodeDecodeError):
        return False


def _discard(folder: Path) -> None:
    """Remove ``folder``, first renamed to a staging name, so that a crash midway leaves no half
    checkpoint under a kept one's name (the next save clears staging folders away)."""
    doomed = folder.with_name(f"{STAGING_PREFIX}drop-{folder.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    try:
        os.replace(folder, doomed)
    except OSError:
        doomed = folder
    shutil.rmtree(doomed, ignore_errors=True)


class _HashingWriter:
    """A file that hashes what is written to it, so that a checkpoint's checksum costs no second
    read of a file that may be many gigabytes."""

    def __init__(self, handle):
        self.handle = handle
        self.digest = hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _save_hashed(value, path: Path) -> str:
    """``torch.save`` to ``path``, on disk (fsync) before it returns; the file's sha256."""
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        torch.save(value, writer)
        handle.flush()
        _fsync(handle.fileno())
    return writer.digest.hexdigest()


def _fsync(descriptor: int) -> None:
    """``os.fsync``, except where the file system cannot sync (some FUSE and network mounts say
    EINVAL or ENOTSUP): the data is written all the same, only not forced to disk."""
    try:
        os.fsync(descriptor)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
            raise


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system syncs a directory (nor needs to)
        descriptor = os.open(folder, os.O_RDONLY)
        try:
            _fsync(descriptor)
        finally:
            os.close(descriptor)


# The checkpoint files whose sha256 this process found to be the recorded one, by what tells their
# contents on disk apart (device, inode, size, modification and change times), so that a file
# checked before any model loads (--model RUN) is not read whole again where it loads. A file
# replaced or written to since has another identity (its ctime, which no one can set, moves
# with any write), and is read again.
_verified: dict[tuple[int, ...], str] = {}
# Only a file unchanged for this long is remembered: file times tick coarsely (a few ms), so a
# file written again within the same tick as its check would keep its identity (git's "racy" files).
SETTLED_NS = 2 * 10**9


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def verify_checkpoint_file(folder: Path, name: str, state: dict | None = None,
                           otherwise: str = "start a new run in another output directory") -> None:
    """Refuse ``folder/name`` when its sha256 is not the one its save recorded in ``state.json``
    (``state``, read here when not given): a byte flipped on disk or a file swapped in would
    otherwise load, and train on, without a word. A checkpoint saved before checksums were kept
    has only its files' shape checked (:func:`_check_whole`). ``otherwise``: what the message
    offers besides restoring the file. A file this process verified already, unchanged since, is
    not read again."""
    if state is None:
        state = json.loads((folder / "state.json").read_text())
    files = state.get("files") if isinstance(state, dict) else None
    if files is None:
        _check_whole(folder / name, otherwise)
        return
    expected = files.get(name) if isinstance(files, dict) else None
    if not isinstance(expected, str):
        raise ConfigError(f"{folder / 'state.json'} has no checksum for {name} ('files' must map each file to its "
                          f"sha256); the checkpoint is left as it is: restore state.json from a copy, or {otherwise}")
    with open(folder / name, "rb") as handle:
        stat = os.fstat(handle.fileno())  # before the read: a write during it changes what is remembered
        if _verified.get(_identity(stat)) == expected:
            return
        actual = hashlib.file_digest(handle, "sha256").hexdigest()
    if actual != expected:
        raise ConfigError(f"{folder / name} is not the file its save wrote: its sha256 ({actual[:12]}…) is not the "
                          f"one recorded in state.json ({expected[:12]}…), so it was changed or damaged since (a "
                          "disk error, a copy cut short). The checkpoint is left as it is; restore the file from a "
                          f"copy, or {otherwise}")
    if time.time_ns() - max(stat.st_mtime_ns, stat.st_ctime_ns) > SETTLED_NS:
        _verified[_identity(stat)] = actual


def _check_whole(path: Path, otherwise: str) -> None:
    """Refuse a file of a checkpoint saved before checksums were kept that is not whole as
    ``torch.save`` wrote it, before any model loads: a zip archive, whose index at the end a copy
    cut short has lost. Only the index is read. A file that cannot be opened (missing, not
    readable) raises the OSError, which its callers name."""
    try:
        with zipfile.ZipFile(path) as archive:
            problem = None if any(n.endswith("data.pkl") for n in archive.namelist()) else "it holds no data.pkl"
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        problem = str(exc) or type(exc).__name__
    if problem is not None:
        raise ConfigError(f"{path} is damaged: it is not a whole file as torch.save writes it (a copy cut short, or "
                          f"a disk error: {problem}). The checkpoint (saved before rftgym kept checksums) is left as "
                          f"it is; restore the file from a copy, or {otherwise}")



def check_rng_states(rng, output_dir: Path) -> None:
    """Refuse random states (from :func:`load_checkpoint`) that are not a training run's."""
    if not isinstance(rng, dict) or not {"tasks", "torch", "ranks"} <= rng.keys() or not isinstance(rng["ranks"], list) \
            or not all(isinstance(r, dict) and {"sampling", "segments"} <= r.keys() for r in rng["ranks"]):
        raise ConfigError(f"{checkpoint_path(output_dir) / 'rng.pt'} does not hold a run's random states (tasks, "
                          "torch, and per rank sampling and segments), so the run cannot continue exactly; the "
                          "checkpoint is left as it is")


def saved_rng_states(output_dir: Path, state: dict | None = None) -> dict[str, Any]:
    """The random states of the checkpoint in ``output_dir`` (``rng.pt``), verified (against
    ``state``, its :func:`saved_state`, read here when not given) and checked: read before any
    model loads, since a resume needs as many processes as wrote them (one entry per rank), and
    then given to :func:`load_checkpoint` rather than read again."""
    path = checkpoint_path(output_dir)
    _verify_for_resume(output_dir, path, "rng.pt", state)
    try:
        rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)  # tensors, dicts and numbers only
    except Exception as exc:  # torch.load raises many types
        raise ConfigError(f"cannot resume from the checkpoint in {output_dir}: {path / 'rng.pt'} is unreadable "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the checkpoint "
                          "is left as it is") from exc
    check_rng_states(rng, output_dir)
    return rng


def check_world_size(written: int, ranks: Distributed, output_dir: Path) -> None:
    """Refuse to resume a checkpoint that ``written`` processes wrote with another number of them:
    each rank continues its own random streams, so the run continues exactly only with as many."""
    if written != ranks.world_size:
        raise ranks.every_rank(ConfigError(
            f"the checkpoint in {output_dir} was written by {written} process{'es' if written != 1 else ''} and this "
            f"run has {ranks.world_size}; resume under `torchrun --nproc_per_node {written}` (or `accelerate launch "
            f"--num_processes {written}`), or start a new run in another --output-dir"))


CHECKPOINT_FILES = ("trainable.pt", "optimizer.pt", "rng.pt")


def check_checkpoint_files(output_dir: Path, state: dict | None = None, already: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint that lacks one of its files (deleted, or a copy cut short) before any
    model loads: a resume needs them all, and loading found the gap only after the model. With
    ``state`` (its :func:`saved_state`), each file is also verified against it
    (:func:`verify_checkpoint_file`: its checksum, or its shape where none was kept), so that a
    damaged one is said before the model loads too (a resume's load then checks none again:
    :func:`load_checkpoint`'s ``verified``). ``already``: files the caller verified so (rng.pt,
    by :func:`saved_rng_states`)."""
    path = checkpoint_path(output_dir)
    missing = [name for name in CHECKPOINT_FILES if path is not None and not (path / name).is_file()]
    if missing:
        raise ConfigError(f"the checkpoint in {output_dir} is incomplete: {path} has no {' and no '.join(missing)} "
                          "(deleted, or a copy cut short), so the run cannot continue from it. The checkpoint is "
                          "left as it is; restore the file from a copy, or start a new run in another output "
                          "directory")
    if state is not None and path is not None:
        for name in CHECKPOINT_FILES:
            if name not in already:
                _verify_for_resume(output_dir, path, name, state)


def _verify_for_resume(output_dir: Path, folder: Path, name: str, state: dict | None) -> None:
    """:func:`verify_checkpoint_file` for a resume, a file that cannot be read (its permissions, a
    disk error) refused as the ConfigError that names it."""
    try:
        verify_checkpoint_file(folder, name, state)
    except OSError as exc:
        raise ConfigError(f"cannot resume from the checkpoint in {output_dir}: {folder / name} cannot be read "
                          f"({exc.strerror or exc}); make it readable to this user, or start a new run in another "
                          "output directory (the checkpoint is left as it is)") from None


# A resumed run must continue the same experiment: these settings change what the checkpoint is
# (another env, algorithm, or LoRA adapters of another shape). The model may be given by another
# path (a moved directory): its weights' fingerprint must be the checkpoint's (check_base_model).
def resume_changes(saved: dict, config: dict, loaded_from: str | None = None) -> list[str]:
    """The settings of ``config`` that differ from the checkpoint's ``saved`` ones (the length of
    the run and how often it logs, saves and evaluates may change freely); a ConfigError for one
    of :data:`RESUME_FIXED`. ``loaded_from``: the absolute directory the checkpoint's model was
    loaded from (state.json's base_model_path), which names the same model as its saved path."""
    for key in RESUME_FIXED:
        if key in saved and not _same_setting(key, saved[key], config.get(key)):
            raise ConfigError(f"the checkpoint in {config.get('output_dir')} was written with {key}={saved[key]!r}; "
                              f"this run has {key}={config.get(key)!r}. Resume with the same {key}, or start a new "
                              "run in another output directory", field=key)
    return sorted(key for key, value in config.items()
                  if key not in RESUME_FREE and key in saved and not _same_setting(key, saved[key], value, loaded_from))


def _as_saved(value) -> str | None:
    """``value`` as state.json writes it (a tuple as a list; True not as 1), or None where JSON cannot hold it."""
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return None


def kept_as_text(value) -> bool:
    """Whether state.json keeps only ``value``'s text (no JSON value holds it, e.g. an object), so
    that a resume cannot read it back."""
    return _as_saved(value) is None


def _same_setting(key: str, saved, value, loaded_from: str | None = None) -> bool:
    # saved values may be strings (a hand edit), and JSON saved tuples (an env's difficulties) as lists
    if str(saved) == str(value) or (_as_saved(saved) is not None and _as_saved(saved) == _as_saved(value)):
        return True
    if key == "env_id" and isinstance(saved, str) and isinstance(value, str):  # `module:` or not, one env
        return same_env_id(saved, value)
    if key == "model" and names_default_model(saved) and names_default_model(value):  # None, 'default': one model
        return True
    if key != "model" or not isinstance(value, str):
        return False
    if isinstance(loaded_from, str) and os.path.isabs(value) \
            and os.path.realpath(value) == os.path.realpath(loaded_from):
        # the directory the checkpoint's model was loaded from, however the run named it (or a run that
        # trained a policy passed in, and named none)
        return True
    if not isinstance(saved, str):
        return False
    # A model directory named another way is the same directory: ./m and m (relative to whatever
    # directory each run started in, so only spelled alike), or two absolute paths to one place.
    if os.path.isabs(saved) and os.path.isabs(value):
        return os.path.realpath(saved) == os.path.realpath(value)
    return not os.path.isabs(saved) and not os.path.isabs(value) and os.path.normpath(saved) == os.path.normpath(value)


def apply_trainable(weights: dict[str, torch.Tensor], model, where: Path) -> None:
    """Copy a checkpoint's trainable weights (``trainable.pt``, from ``where``) into ``model``,
    whose parameters of those names must have those shapes (a ValueError says otherwise)."""
    params = dict(inner_model(model).named_parameters())
    unknown = [name for name in weights if name not in params]
    wrong = [name for name in weights if name in params and weights[name].shape != params[name].shape]
    if unknown or wrong or not weights:
        raise ValueError(f"the checkpoint in {where} does not match the model ({len(unknown)} unknown parameters, "
                         f"{len(wrong)} of other shapes, e.g. {(unknown + wrong)[:2]}); use the model and LoRA "
                         "settings that wrote it")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(shard_like(tensor, params[name]).to(params[name].device, params[name].dtype))


def load_checkpoint(output_dir: Path, *, model, optimizer, state: dict | None = None,
                    rng_states: dict[str, Any] | None = None,
                    verified: bool = False) -> tuple[int, dict[str, Any], dict]:
    """:func:`_load_checkpoint`, with any unreadable or mismatched file reported as a ConfigError
    that names it (the files are left as they are). What the caller read already is not read
    again: ``state``, the checkpoint's :func:`saved_state`; ``rng_states``, its random states as
    :func:`saved_rng_states` read them; and, with ``verified``, the check of every file against
    ``state`` (:func:`check_checkpoint_files`, made by a run that holds the output directory's
    lock, so that no save changes them meanwhile)."""
    try:
        return _load_checkpoint(output_dir, model=model, optimizer=optimizer, state=state, rng_states=rng_states,
                                verified=verified and state is not None)
    except ConfigError:
        raise
    except Exception as exc:  # torch.load, json and load_state_dict raise many types
        raise ConfigError(f"cannot resume from the checkpoint in {output_dir}: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}. Resume with the model and LoRA settings "
                          "that wrote it, or start a new output directory (the checkpoint is left as it is)") from exc


def _load_checkpoint(output_dir: Path, *, model, optimizer, state: dict | None = None,
                     rng_states: dict[str, Any] | None = None,
                     verified: bool = False) -> tuple[int, dict[str, Any], dict]:
    """Restore weights and optimizer in place; return (step, rng states, saved config).

    Sharded (FSDP) parameters and optimizer states get this rank's shard of the saved tensors."""
    path = checkpoint_path(output_dir)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {output_dir}")
    if state is None:
        state = json.loads((path / "state.json").read_text())
        check_state(state, path / "state.json")
    if not verified:  # all, before anything is changed
        check_checkpoint_files(output_dir, state)
    apply_trainable(torch.load(path / "trainable.pt", map_location="cpu"), model, path)
    saved = torch.load(path / "optimizer.pt", map_location="cpu")
    # Saved indices follow the optimizer's parameter order; per-parameter states (AdamW's
    # moments) are laid out like their parameter, scalars (the step count) are left as they are.
    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    owner = dict(zip(indices, ordered))
    for index, entry in saved["state"].items():
        param = owner.get(index)
        for key, value in entry.items():
            if param is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                entry[key] = shard_like(value, param)
    if not isinstance(optimizer, MasterWeights):
        # A bf16 run resumed without 16-bit weights: its float32 masters are the better weights
        # (those loaded above are their rounding), and plain AdamW keeps no masters.
        with torch.no_grad():
            for index, entry in saved["state"].items():
                master, param = entry.get("master"), owner.get(index)
                if master is not None and param is not None and master.shape == param.shape:
                    param.copy_(master.to(param.device, param.dtype))
        saved["state"] = {index: rest for index, entry in saved["state"].items()
                          if (rest := {k: v for k, v in entry.items() if k != "master"})}
    # The run's own settings (weight decay; fused, which the device decides), not the saved ones:
    # load_state_dict restores a group's settings with its moments, and a resume may change them
    # (resume_notes names each). The learning rate is set at each step from the schedule.
    for group, current in zip(saved["param_groups"], optimizer.param_groups):
        group.update({key: value for key, value in current.items() if key != "params"})
    optimizer.load_state_dict(saved)
    if rng_states is None:
        rng_states = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)  # tensors, dicts, numbers
    return int(state["step"]), rng_states, state["config"]


def resume_notes(saved: dict, config: TrainConfig) -> list[str]:
    """What a resumed run changes from its checkpoint's settings (``saved``: the checkpoint's step
    and config; a ConfigError for what it may not change, :data:`RESUME_FIXED`),
    and where a longer or shorter run moves a decaying learning rate."""
    settings, step = saved["config"], saved["step"]
    notes = []
    now = config.to_dict()

    def value(v) -> str:
        text = repr(v)
        return text if len(text) <= 60 else text[:57] + "..."

    # Fields the checkpoint names that this version does not know (a hand edit's typo, or a later
    # version's setting) or lacks (an earlier version's checkpoint): the run goes on without them.
    unknown = sorted(set(settings) - set(now))
    if unknown:
        def guess(key: str) -> str:
            close = difflib.get_close_matches(key, now, n=1)
            return f" (did you mean {close[0]}?)" if close else ""

        notes.append("the checkpoint's settings (checkpoint/state.json) hold fields this version does not know, "
                     "which the resume ignores: " + ", ".join(key + guess(key) for key in unknown))
    # (one at its default is what the earlier version did: no note)
    missing = sorted(key for key in set(now) - set(settings)
                     if key not in RESUME_FREE and _as_saved(now[key]) != _as_saved(_default(key)))
    if missing:
        notes.append("the checkpoint's settings (checkpoint/state.json) lack " + ", ".join(missing) + "; this run "
                     "has " + ", ".join(f"{key}={value(now[key])}" for key in missing))
    changed = resume_changes(settings, now, saved.get("base_model_path"))
    if changed:
        notes.append("resuming with settings that differ from the checkpoint's: "
                     + ", ".join(f"{key} {value(settings[key])} -> {value(now[key])}" for key in changed))
    if config.lr_schedule != "constant" and isinstance(settings.get("steps"), int) and settings["steps"] != config.steps:
        def rate(c: dict) -> float:
            return learning_rate_at(step, base=float(c["learning_rate"]), total_steps=int(c["steps"]),
                                    schedule=c["lr_schedule"], warmup_steps=int(c["warmup_steps"]),
                                    min_ratio=float(c["min_lr_ratio"]))
        try:  # the checkpoint's run as it was set up (an older one may lack a setting: today's then)
            planned, now = rate({**config.to_dict(), **settings}), rate(config.to_dict())
        except (ConfigError, ValueError, KeyError, TypeError):
            return notes
        notes.append(f"the {config.lr_schedule} learning-rate schedule now spans {config.steps} steps, not "
                     f"{settings['steps']}: the run resumes at step {step + 1} with a rate of {now:.3g}, where the "
                     f"checkpoint's run would have had {planned:.3g}")
    return notes
