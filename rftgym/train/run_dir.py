"""A training run's output directory: what lies where, whether it holds a checkpoint, whether a
run may start there, and the lock and the footprint a run keeps while it writes there.

Layout: ``checkpoint/`` (the last complete checkpoint; ``.checkpoint-old/`` for a moment while a
new one takes its place, ``.checkpoint-*`` while one is written), ``checkpoint-<step>/`` (earlier
checkpoints the run keeps, ``keep_checkpoints``), ``metrics.jsonl``, ``learning_curve.png``,
``tensorboard/`` and ``.lock``.

A kept checkpoint's folder reads as the run at that step wherever a run's directory is read (its
model: ``rftgym eval --model RUN/checkpoint-40``, ``rftgym export RUN/checkpoint-40 OUT``); a run
resumes from its last checkpoint only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

from ..core.errors import ConfigError, TrainingError, warn_caller
from ..core.values import is_int

CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
STAGING_PREFIX = ".checkpoint-"  # a checkpoint being written, renamed to CHECKPOINT_DIR when whole
OLD_CHECKPOINT_DIR = ".checkpoint-old"  # the previous checkpoint, while the new one takes its place
KEPT_PREFIX = "checkpoint-"  # checkpoint-<step>: an earlier checkpoint the run keeps
KEPT_MARKER = ".kept"  # in each checkpoint-<step>/ a run kept: only those are its to remove
LOCK_FILE = ".lock"
LEARNING_CURVE = "learning_curve.png"
TENSORBOARD_DIR = "tensorboard"  # (metrics_log.MetricsLog writes there)


def kept_step(folder: Path) -> int | None:
    """The step of an earlier checkpoint's folder by its name (``checkpoint-40``: 40), else None."""
    number = folder.name[len(KEPT_PREFIX):] if folder.name.startswith(KEPT_PREFIX) else ""
    return int(number) if number.isascii() and number.isdigit() else None


def is_kept_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is one of the earlier checkpoints a run keeps beside its last one."""
    return kept_step(folder) is not None and (folder / "state.json").is_file()


def is_checkpoint_folder(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint of a run: its last (``RUN/checkpoint``) or an earlier one
    it keeps (``RUN/checkpoint-40``). Either reads as the run at its step."""
    return (folder.name == CHECKPOINT_DIR or kept_step(folder) is not None) and (folder / "state.json").is_file()


def kept_checkpoints(output_dir: Path) -> dict[int, Path]:
    """The earlier checkpoints in ``output_dir`` (``checkpoint-<step>/`` holding a state.json, not
    another tool's folder of that name) by step, oldest first."""
    try:
        found = {kept_step(entry): entry for entry in output_dir.iterdir()
                 if not entry.is_symlink() and is_kept_checkpoint(entry)}
    except OSError:
        return {}
    return dict(sorted(found.items()))


def checkpoint_path(output_dir: Path) -> Path | None:
    if is_checkpoint_folder(output_dir):  # RUN/checkpoint-40 read as the run at step 40
        return output_dir
    # A crash between the two renames of a save leaves only the previous checkpoint, under its
    # temporary name: it is still a complete checkpoint.
    for name in (CHECKPOINT_DIR, OLD_CHECKPOINT_DIR):
        if (output_dir / name / "state.json").is_file():
            return output_dir / name
    return None


def how_to_continue(output_dir: Path) -> str:
    """What to run once a failure to write is mended: resume from the last complete checkpoint, or,
    before the first one, start again (``--resume`` would find nothing to resume)."""
    path = checkpoint_path(output_dir)
    if path is None:
        # A new run refuses an output directory that holds an earlier run's metrics.
        return ("then start the run again in another --output-dir (no checkpoint has been written yet, so there is "
                "nothing to resume)")
    try:
        step = json.loads((path / "state.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        step = None
    at = f" at step {step}" if is_int(step) else ""
    return f"then run it again with --resume, which continues from the last checkpoint{at}"


def has_checkpoint(output_dir: Path) -> bool:
    return checkpoint_path(output_dir) is not None


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is a training run's output directory holding a complete checkpoint."""
    path = Path(path).expanduser()
    return path.is_dir() and has_checkpoint(path)


def has_checkpoint_files(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds any checkpoint folder, complete or not (a new run there would
    overwrite it)."""
    return (any((output_dir / name).exists() for name in (CHECKPOINT_DIR, OLD_CHECKPOINT_DIR))
            or bool(kept_checkpoints(output_dir)))


def check_output_dir(output_dir: Path, resume: bool) -> None:
    """Refuse a run that would overwrite a checkpoint (complete or not) or an earlier run's metrics
    without ``resume``, a ``resume`` with no complete checkpoint, and an output directory that
    cannot be one."""
    try:
        _check_output_dir(output_dir, resume)
    except OSError as exc:  # a name too long, a folder that cannot be read
        raise ConfigError(f"cannot use the output directory {output_dir}: {exc.strerror or exc}") from None


def _check_output_dir(output_dir: Path, resume: bool) -> None:
    if is_checkpoint_folder(output_dir) and not is_kept_checkpoint(output_dir):
        raise ConfigError(f"{output_dir} is the last checkpoint of the run in {output_dir.parent}, not a run's output "
                          f"directory (a run there would be replaced by that run's next save); to go on with that "
                          f"run: --output-dir {output_dir.parent} --resume")
    if is_kept_checkpoint(output_dir):
        raise ConfigError(f"{output_dir} is an earlier checkpoint the run in {output_dir.parent} keeps, not a run's "
                          f"output directory; a run resumes from its last checkpoint (--output-dir "
                          f"{output_dir.parent} --resume). To go on from step {kept_step(output_dir)} instead, copy "
                          f"the folder to NEW/checkpoint and resume there (--output-dir NEW --resume)")
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"the output directory {output_dir} is a file; choose a directory")
    held = next((f"{what} ({name})" for name, what in (("config.json", "a model"),
                                                       ("adapter_config.json", "LoRA adapters"))
                 if (output_dir / name).is_file()), None)
    if held is not None:
        # A checkpoint there would make the folder read as a run's (--model DIR loads a run's model
        # first), and a run trained from that model would then name itself as its base.
        raise ConfigError(f"the output directory {output_dir} holds {held}; a run's checkpoint there would make it "
                          "read as the run's directory instead. Choose another output directory (e.g. "
                          f"{output_dir.parent / (output_dir.name + '-run')})")
    holder = lock_holder(output_dir)
    if holder is not None:  # before what its files say: a live run's are not an earlier run's
        raise ConfigError(_locked_message(output_dir, holder))
    for name, is_folder, what in ((METRICS_FILE, False, "metrics"), (LEARNING_CURVE, False, "learning curve"),
                                  (TENSORBOARD_DIR, True, "TensorBoard logs"), (CHECKPOINT_DIR, True, "checkpoint")):
        path = output_dir / name
        if path.exists() and path.is_dir() != is_folder:
            raise ConfigError(f"{path} is a {'file' if is_folder else 'directory'}, where the run writes its {what}; "
                              "move it away or choose another output directory")
    if has_checkpoint_files(output_dir) and not resume:
        kept = ", ".join(folder.name for folder in kept_checkpoints(output_dir).values())
        if kept and not (output_dir / CHECKPOINT_DIR).exists() and not has_checkpoint(output_dir):
            raise ConfigError(f"{output_dir} holds earlier checkpoints of a run ({kept}) that a new run would mix with "
                              "its own; choose another output directory, or move them away first")
        if not has_checkpoint(output_dir):
            raise ConfigError(f"{output_dir} holds an incomplete checkpoint (no {CHECKPOINT_DIR}/state.json: a run "
                              "stopped while writing it, or a copy cut short), which cannot be resumed and which a "
                              f"new run would overwrite; move {output_dir / CHECKPOINT_DIR} away or choose another "
                              "output directory")
        raise ConfigError(f"{output_dir} already holds a checkpoint; resume it (rftgym train --resume, or "
                          "train(..., resume=True)), or choose another output directory")
    if resume and not has_checkpoint(output_dir):
        if not output_dir.exists():
            raise ConfigError(f"nothing to resume: {output_dir} does not exist; give the --output-dir of an earlier "
                              "run, or drop --resume to start a new run there")
        raise ConfigError(f"nothing to resume: {output_dir} holds no complete checkpoint (checkpoint/state.json is "
                          "missing); give the --output-dir of an earlier run, or drop --resume to start a new run")
    metrics = output_dir / METRICS_FILE
    if not resume and metrics.is_file() and metrics.stat().st_size > 0:
        raise ConfigError(f"{output_dir} holds the metrics of an earlier run ({METRICS_FILE}) and no checkpoint to "
                          "resume; a new run would overwrite them. Choose another output directory, or move them "
                          "away first")
    if not resume and (output_dir / LEARNING_CURVE).is_file():
        raise ConfigError(f"{output_dir} holds a {LEARNING_CURVE} that a new run would overwrite with its own; choose "
                          "another output directory, or move it away first")


class OutputLock:
    """An exclusive lock on an output directory, held while a run writes there, so that a second
    run into the same directory is refused rather than mixing its metrics and checkpoints with
    the first one's. The operating system releases it when the process ends, however it ends.
    On a file system without ``flock`` (some NFS and Lustre mounts) the run goes on unlocked,
    with a warning."""

    def __init__(self, output_dir: Path):
        self.path = output_dir / LOCK_FILE
        self._file = None
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        try:
            handle = open(self.path, "a+", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise ConfigError(_locked_message(output_dir, lock_holder(output_dir))) from None
            warn_caller(f"cannot lock {self.path} ({exc.strerror or exc}); nothing stops a second run from "
                        "writing to the same output directory")
            return
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        except OSError as exc:  # e.g. a full disk: the directory was fine, the file could not be written
            with contextlib.suppress(OSError):  # closing flushes the same buffered text, and fails alike
                handle.close()
            raise TrainingError(f"cannot write the lock file {self.path} ({exc.strerror or exc}); free space or "
                                "choose another output directory") from None
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.truncate(0)  # no stale process id is left behind
            self._file.close()
            self._file = None


RUN_FILES = (LOCK_FILE, METRICS_FILE, LEARNING_CURVE, TENSORBOARD_DIR)  # what a run adds beside its checkpoint


class RunFootprint:
    """What a run adds to its output directory, noted before it adds anything, so that a run that
    stops before it has written a result (a metrics row or a checkpoint: a refused setting, a
    crash in the first step, Ctrl-C) leaves the directory as it found it. Only what this run made
    is removed (its lock, metrics and TensorBoard files, and the folders it created, the output
    directory and any above it), never a file an earlier run wrote; a run that wrote a result
    keeps everything."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.results_written = False
        self._writers: list = []  # closed before their files are removed (TensorBoard writes from a thread)
        try:
            self._made_folders = []  # deepest first
            folder = output_dir
            while not os.path.lexists(folder):
                self._made_folders.append(folder)
                folder = folder.parent
            self._before: set[Path] | None = self._entries()
        except OSError:  # what was there cannot be told: nothing will be removed
            self._before = None

    def close_before_removing(self, writer) -> None:
        """``writer`` (anything with ``close()``) writes into the run's files: it is closed before
        they are removed, so that no thread of it writes on into a removed folder."""
        self._writers.append(writer)

    def _entries(self) -> set[Path]:
        found = {self.output_dir / name for name in RUN_FILES if os.path.lexists(self.output_dir / name)}
        board = self.output_dir / TENSORBOARD_DIR
        if board.is_dir() and not board.is_symlink():  # a resumed run adds its events file to the old ones
            found.update(board.iterdir())
        return found

    def remove_unless_results(self, held_lock: bool = True) -> None:
        """Remove what the run made, unless it wrote a result; call while the run holds its lock.
        A run refused before it held the lock (``held_lock=False``) may have met another run that
        holds it now, whose files these may be: only the empty folders it made itself go."""
        if self.results_written or self._before is None:
            return
        for writer in self._writers:
            with contextlib.suppress(Exception):  # (a writer that fails to close must not keep its files)
                writer.close()
        try:
            made = self._entries() - self._before if held_lock else set()
        except OSError:
            return
        # Deepest first: a folder this run made is empty once its own files are gone.
        for path in [*sorted(made, key=lambda p: len(p.parts), reverse=True), *self._made_folders]:
            with contextlib.suppress(OSError):  # a folder that is not empty (someone else's files) stays
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()


def lock_holder(output_dir: Path) -> str | None:
    """The process id written by the run that holds ``output_dir``'s lock ("unknown" if it wrote
    none yet), or None when no run holds it."""
    path = output_dir / LOCK_FILE
    try:
        import fcntl

        handle = open(path, encoding="utf-8")
    except (ImportError, OSError):
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                return handle.read().strip() or "unknown"
            return None
        return None  # the shared lock is dropped when the file closes


def _locked_message(output_dir: Path, holder: str | None) -> str:
    return (f"another run (process {holder or 'unknown'}) is writing to {output_dir}; wait for it to end, or choose "
            "another output directory")


def check_state(state, where: Path) -> None:
    """Refuse a ``state.json`` (read from ``where``) that is no checkpoint state: it needs the
    number of steps done and the run's settings."""
    step = state.get("step") if isinstance(state, dict) else None
    if not is_int(step) or step < 0 or not isinstance(state.get("config"), dict):
        raise ConfigError(f"{where} is not a checkpoint state (it needs 'step', the number of steps done: an int "
                          f">= 0, and a 'config'); got step {step!r}. The checkpoint is left as it is")


def saved_state(output_dir: Path, doing: str = "resume from") -> dict:
    """The step and config of the checkpoint in ``output_dir`` (read before any model loads);
    ``doing`` is what the caller does with it, for the messages."""
    path = checkpoint_path(output_dir)
    if path is None:
        model_files = " It is a model directory (config.json), not a training run: HFPolicy.from_pretrained(DIR) or " \
            "transformers' AutoModelForCausalLM.from_pretrained(DIR) loads it" \
            if (Path(output_dir) / "config.json").is_file() else ""
        raise ConfigError(f"nothing to {doing.split()[0]}: {output_dir} holds no complete checkpoint.{model_files}")
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot {doing} the checkpoint in {output_dir}: {path / 'state.json'} is unreadable "
                          f"({exc}); the checkpoint is left as it is") from None
    check_state(state, path / "state.json")
    return state


def resumed_model(state: dict, model: str | None) -> str | None:
    """The model a resume that names none of its own loads: the directory its checkpoint's model
    was loaded from (state.json's ``base_model_path``, absolute) while it is there, so that a
    model given by a path relative to where the first run started is found from anywhere; else
    ``model``, the setting as saved (None: the default model)."""
    loaded_from = state.get("base_model_path")
    if not isinstance(loaded_from, str) or os.path.isdir(loaded_from):
        return loaded_from or model
    if model is None or not os.path.isdir(os.path.expanduser(model)):
        raise ConfigError(f"the checkpoint's base model was loaded from {loaded_from}, which is no directory now "
                          "(moved or removed); give the directory it moved to (--model DIR; from Python, model=DIR)",
                          field="model")
    return model
