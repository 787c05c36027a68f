"""Where an evaluation writes its episodes: the --out checks made before any episode runs (never
a directory, an input file, the source of a module the run imports, or any existing file but an
earlier evaluation's episodes), the partial file the episodes stream to, and default names that no
other run has (claimed, so that runs started together do not share one)."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import IO, Collection, Sequence

from ..core.files import drop_unfinished_line
from ..core.jsonl import GZIP_MAGIC
from .common import UsageError
from .environments import _env_class, _env_spec
from .sigterm import say
from .user_code import _module_source


def _users_sources(env_ids: Sequence[str], agent: str, baselines: bool) -> dict[str, tuple[str, str]]:
    """The Python source files of the modules this evaluation imports to run what it was given:
    an env's ``module:EnvId`` module and its entry point's, ``--agent module:name``'s, and with
    ``--baselines`` the baselines' wrappers' (each with the packages above it). Real path ->
    (module, what named it), so that ``--out`` is never one of them."""
    named: dict[str, str] = {}
    for env_id in env_ids:
        module = env_id.rpartition(":")[0]
        if module:
            named.setdefault(module, f"the environment {env_id}")
        entry = _env_spec(env_id).entry_point
        named.setdefault(entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", ""),
                         f"the environment {env_id}")
        for _, _, wrapper in _env_class(env_id).metadata.get("eval_baselines", ()) if baselines else ():
            if wrapper:
                named.setdefault(wrapper.partition(":")[0], f"the baselines of {env_id}")
    if ":" in agent:
        named.setdefault(agent.partition(":")[0], f"--agent {agent}")
    sources: dict[str, tuple[str, str]] = {}
    for module, what in named.items():
        parts = module.split(".") if module else []
        for depth in range(len(parts), 0, -1):  # the module, then the packages it is in
            source = _module_source(".".join(parts[:depth]))
            if source is not None:
                sources.setdefault(os.path.realpath(source), (".".join(parts[:depth]), what))
    return sources


def _writable_file(path: Path, what: str, inputs: dict | None = None, folders: dict | None = None,
                   sources: dict[str, tuple[str, str]] | None = None, resuming: bool = False) -> None:
    """Refuse an output file path that cannot be written, or that names one of the run's input
    files (an ``--env-arg`` path, a file in one of the input ``folders``: flag -> directory, such
    as the model's, or the source of a module imported for the run: :func:`_users_sources`), or
    any other non-empty file that does not hold episodes, before any episode runs. Creating the
    partial file beside it (:func:`_partial`) is the test: it is where the episodes go while the
    run lasts."""
    try:
        if path.is_dir():
            # With one env a trailing slash names a directory to write in (several envs always do).
            raise UsageError(f"{what} {path} is a directory; give a file name ending in .jsonl (e.g. "
                             f"{path / 'eval.jsonl'}), or {os.path.join(path, '')} with a trailing slash for a file "
                             "named for the run in it")
        if path.exists() and not path.is_file():  # the finished file replaces it: never a device or a pipe
            raise UsageError(f"{what} {path} is not a regular file (a device, pipe or socket); the episodes are "
                             "written to a file that replaces it, so give a file name ending in .jsonl")
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UsageError(f"{what} {path} cannot be written: {blocking} is a file, not a directory")
        for key, value in (inputs or {}).items():
            # realpath resolves a path through a directory not made yet ("new/../tasks.jsonl") too.
            if isinstance(value, str) and value and Path(value).exists() and (
                    os.path.samefile(path, value) if path.exists()
                    else os.path.realpath(path) == os.path.realpath(value)):
                raise UsageError(f"{what} {path} is the file given as --env-arg {key}; the evaluation would "
                                 "overwrite its own input. Give another --out")
        code = (sources or {}).get(os.path.realpath(path))
        if code is not None:
            module, named_by = code
            raise UsageError(f"{what} {path} is the source of the Python module {module!r}, imported for {named_by}; "
                             "the evaluation would overwrite that code with its episodes. Give another --out")
        if path.is_file() and path.stat().st_size > 0 and not _holds_episodes(path):
            # An earlier evaluation's episodes are replaced (a rerun); any other file is the user's.
            owner = next((f"a file of the {flag} directory {folder}" for flag, folder in (folders or {}).items()
                          if os.path.isdir(folder) and path.resolve().is_relative_to(Path(folder).resolve())),
                         "a file that is not an earlier evaluation's episodes")
            raise UsageError(f"{what} {path} is {owner}; the evaluation would overwrite it with its episodes. Give "
                             "another --out, or move the file away")
        path.parent.mkdir(parents=True, exist_ok=True)
        # The lock first: a running evaluation's partial file is refused as that, not as one an
        # earlier run left (whose advice, to move it away, would make room for a second writer).
        _hold_partial(path, what)
        if not resuming:
            try:
                _check_partial(path)
            except UsageError:
                release_partials([path])
                raise
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be written: {exc.strerror or exc}") from None


def _holds_episodes(path: Path) -> bool:
    """Whether ``path`` starts as an episode record does (an earlier evaluation's --out): by its
    first bytes only, since a model's weights file may have no line end for gigabytes."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(len(EPISODE_START))
        if start.startswith(GZIP_MAGIC):  # an --out ending in .gz
            with gzip.open(path, "rb") as handle:
                start = handle.read(len(EPISODE_START))
        return start == EPISODE_START
    except (OSError, EOFError):  # (gzip raises BadGzipFile, an OSError, or EOFError for a cut stream)
        return False


EPISODE_START = b'{"env_id": '  # how every line of rftgym's episode files starts (Episode.to_json)


def _partial(path: Path) -> Path:
    """Where an evaluation streams its finished episodes until it completes and replaces ``path``."""
    return path.with_name(path.name + ".partial")


# The partial files this process's evaluations write, each open under an exclusive lock while the
# evaluation lasts: another evaluation given the same --out is refused rather than writing its
# episodes into the same file (the lock goes with the process, so a run that died leaves none).
_HELD_PARTIALS: dict[str, IO] = {}


def _hold_partial(path: Path, what: str = "--out") -> None:
    """Create ``path``'s partial file if need be and lock it for this process; a UsageError where
    another evaluation holds it now."""
    partial = _partial(path)
    key = os.path.realpath(partial)
    if key in _HELD_PARTIALS:
        return
    for attempt in range(3):
        handle = partial.open("a", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise UsageError(f"{what} {path}: another evaluation running now writes its episodes to {partial} (it "
                             f"was given the same {what}); wait for it to end, or give another {what}") from None
        except OSError:  # a file system without locks: unguarded, as files are there
            break
        # The file locked must still be the one at that name: an evaluation that just finished
        # removes its own after its last episode (then this opens the name again).
        try:
            if os.fstat(handle.fileno()).st_ino == os.stat(partial).st_ino:
                break
        except FileNotFoundError:
            pass
        if attempt == 2:  # (replaced again and again: keep the last, as a file system without locks would)
            break
        handle.close()
    _HELD_PARTIALS[key] = handle


def holds_partial(path: Path) -> bool:
    """Whether this process holds ``path``'s partial file (:func:`_hold_partial`)."""
    return os.path.realpath(_partial(path)) in _HELD_PARTIALS


def release_partials(paths: Sequence[Path]) -> None:
    """Let go of the partial files of ``paths`` this process holds (its evaluations are over)."""
    for path in paths:
        handle = _HELD_PARTIALS.pop(os.path.realpath(_partial(path)), None)
        if handle is not None:
            handle.close()


def _check_partial(path: Path) -> None:
    """Refuse to start over the episodes an earlier, unfinished evaluation left in the partial file."""
    if _holds_finished_episodes(path):
        raise UsageError(f"{_partial(path)} holds the episodes of an earlier evaluation that did not complete; finish "
                         "it with the same command and --resume, move or delete the file, or give another --out")


def _holds_finished_episodes(path: Path) -> bool:
    partial = _partial(path)
    return partial.is_file() and partial.stat().st_size > 0


def _partial_settings(path: Path) -> Path:
    """Where an evaluation notes, beside its partial file, the settings its episodes ran with, so
    that ``--resume`` adds only episodes of the same evaluation."""
    return path.with_name(path.name + ".partial.json")


NOTED_LATER = ("weights", "model_step", "dtype", "data_files")  # settings an earlier version's partial files lack


def _file_options(env_args: dict) -> dict[str, str]:
    """An env's options that name a file there is (``dataset_path``, ``corpus_path``: any ``*_path``)."""
    return {key: value for key, value in env_args.items()
            if key.endswith("_path") and isinstance(value, str) and value and os.path.isfile(value)}


def absolute_file_options(env_args: dict) -> dict:
    """``env_args`` with its file options as full paths: the same file named from another directory
    is the same file, and another file under the same relative name is not."""
    files = _file_options(env_args)
    return {key: os.path.abspath(files[key]) if key in files else value for key, value in env_args.items()}


def data_file_fingerprints(env_args: dict) -> dict[str, str]:
    """The sha256 of each file an env option names, by option."""
    fingerprints = {}
    for key, value in _file_options(env_args).items():
        digest = hashlib.sha256()
        try:
            with open(value, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        except OSError:
            continue  # unreadable: the env refuses it, naming it
        fingerprints[key] = digest.hexdigest()
    return fingerprints


def _without_env_args(settings: dict, names: Sequence[str]) -> dict:
    env_args = settings.get("env_args")
    if not names or not isinstance(env_args, dict):
        return settings
    return {**settings, "env_args": {key: value for key, value in env_args.items() if key not in names}}


def _finished_episodes(path: Path, env_id: str, seeds: Sequence[int], settings: dict,
                       transport: Sequence[str] = ()) -> list:
    """The episodes an interrupted evaluation of these ``settings`` finished, from ``path``'s
    partial file: refused when the partial file was written with other settings (but for the env
    options in ``transport``, which say how a service is reached), or holds an episode of another
    env or seed. A last line cut short (the process killed while writing it) is dropped from the
    file, with a note."""
    from ..core.errors import DataFormatError
    from ..core.records import read_episodes_jsonl

    partial, noted = _partial(path), _partial_settings(path)
    try:
        saved = json.loads(noted.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume: cannot read {noted}, the settings {partial} was written with "
                         f"({getattr(exc, 'strerror', None) or exc}), so there is no telling that its episodes are this "
                         "evaluation's; move both away to run it afresh") from None
    # What an earlier version did not note is not compared; it took the model's path as it was typed.
    settings = {**settings, **{key: None for key in NOTED_LATER if key not in saved}}
    if "weights" not in saved and saved.get("model") and Path(saved["model"]).expanduser().exists():
        saved = {**saved, "model": str(Path(saved["model"]).expanduser().resolve())}
    if "stop" not in saved:  # (no version before --stop stopped a reply at a string)
        saved = {**saved, "stop": []}
    if "data_files" not in saved and isinstance(saved.get("env_args"), dict):  # noted as typed, then
        saved = {**saved, "env_args": absolute_file_options(saved["env_args"])}
    saved, settings = (_without_env_args(s, transport) for s in (saved, settings))
    differ = [key for key, value in settings.items() if saved.get(key) != value]
    if "data_files" in differ:
        before = saved.get("data_files") if isinstance(saved.get("data_files"), dict) else {}
        files = [f"{key} ({settings['env_args'].get(key)})" for key in sorted(set(before) | set(settings["data_files"]))
                 if before.get(key) != settings["data_files"].get(key)]
        raise UsageError(f"--resume: the episodes in {partial} ran on other data: {', '.join(files)} held something "
                         "else then (its sha256 differs); put back the file they ran on, or move the partial file away "
                         "to evaluate this one afresh")
    if differ and set(differ) <= {"weights", "model_step"}:
        steps = (f" (the run's step {saved.get('model_step')} then, {settings['model_step']} now)"
                 if "model_step" in differ else "")
        raise UsageError(f"--resume: the episodes in {partial} ran with other weights than {settings['model']} holds "
                         f"now{steps}: a run trained on, or a model written over; give the model they ran with (a "
                         "run's checkpoint-<step> folder), or move the partial file away to evaluate these weights "
                         "afresh")
    changed = [f"{key} {saved.get(key)!r} -> {settings[key]!r}" for key in differ]
    if changed:
        raise UsageError(f"--resume: the episodes in {partial} ran with other settings ({'; '.join(changed)}); give "
                         "the command that started them, or move the partial file away to run afresh")
    if drop_unfinished_line(partial):  # a line cut short has no line end: its process died writing it
        say(f"--resume: dropped the unfinished last line of {partial} (its process stopped while writing it)")
    try:
        episodes = list(read_episodes_jsonl(partial))
    except DataFormatError as exc:
        raise UsageError(f"--resume: {exc}; move {partial} away to run the evaluation afresh") from None
    planned, seen = set(seeds), set()
    recorded_id = env_id.rpartition(":")[2]  # an episode names its env by its spec's id, without module:
    for episode in episodes:
        if episode.seed in seen:
            problem = f"two episodes of seed {episode.seed}"
        elif episode.env_id != recorded_id or episode.seed not in planned:
            problem = (f"an episode of {episode.env_id}, seed {episode.seed}, which this evaluation does not run "
                       f"({env_id}, seeds {seeds[0]} to {seeds[-1]})")
        else:
            seen.add(episode.seed)
            continue
        raise UsageError(f"--resume: {partial} holds {problem}; move it away to run afresh")
    return episodes


def _claim_unique(path: Path, taken: Collection[Path] = ()) -> Path:
    """A default output name of this run's own: ``path``, or ``stem-2``, ``stem-3``... beside it,
    the first that no file has (a run in the same second), that is not ``taken`` by another file of
    this run (two envs of the same name in other namespaces), and that no other evaluation holds.
    The name is claimed by creating its partial file, exclusively: evaluations started together
    (other seeds, say) would otherwise all pick one name and write each other's episodes over."""
    candidate, number = path, 2
    while candidate.exists() or candidate in taken or not _claim_partial(candidate):
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
        number += 1
    return candidate


def _claim_partial(path: Path) -> bool:
    """Create ``path``'s empty partial file, unless another evaluation has one there (False). A
    place that cannot be written counts as claimed: the --out checks say what is wrong with it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return True
    try:
        _partial(path).open("x", encoding="utf-8").close()
    except FileExistsError:  # another evaluation's, running or stopped unfinished
        return False
    except OSError:
        return True
    try:
        _hold_partial(path)
    except UsageError:  # another evaluation made it just now
        return False
    except OSError:
        pass
    return True
