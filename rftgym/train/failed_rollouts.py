"""What a training run keeps of a rollout that failed: the episodes it had finished.

When an env breaks (its sandbox, a retrieval server) or the policy's server goes away in the
middle of a step's rollout, the run stops with that error; the episodes the rollout had finished
are what shows what the policy did just before. :func:`~rftgym.rollout.run_episodes` hands them
over on the exception (``exc.finished_episodes``), and :func:`keeping_finished_episodes` writes
them to the output directory in the format ``rftgym eval`` writes (one :meth:`Episode.to_json`
per line, read by :func:`~rftgym.core.records.read_episodes_jsonl`), says where on stderr, and
lets the error go on unchanged.

- The file is ``failed-step-N.episodes.jsonl`` (``failed-eval-step-N`` for the evaluation after
  step N), N counted from 1 as the progress lines count steps; a resumed run that fails at the
  same step again writes over it, as the newer failure is the one to look at.
- It is kept even when the run had written no result yet, and so removes its other files
  (:class:`~rftgym.train.run_dir.RunFootprint`): a run that names a file must not delete it,
  and a rollout that fails at once (an env misconfigured) is where the file helps most. It does
  not stop a new run in that directory.
- A stop (Ctrl-C, SIGTERM, SIGHUP: a KeyboardInterrupt) writes nothing: it is no failure to look
  into, and the resumed run redoes that step with the same random states.
- Under a launch of several ranks, the rank whose rollout failed writes its own episodes
  (``failed-step-N.rank-R.episodes.jsonl``); the others finished theirs and stop with it.
- When the rollout finished but its training samples cannot be built from the episodes (an env
  breaking its contract in a turn's info, a policy that recorded no log-probs), all of the
  step's episodes are kept in the same file: they hold the turn the error names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from ..core.records import write_episodes_jsonl
from .distributed import Distributed
from .stopping import say


def failed_episodes_path(output_dir: Path, step: int, ranks: Distributed, phase: str = "rollout") -> Path:
    """Where the finished episodes of step ``step``'s (its number, as metrics rows show it) failed
    ``phase`` ("rollout" or "evaluation") go on this rank."""
    what = "eval-step" if phase == "evaluation" else "step"
    rank = f".rank-{ranks.rank}" if ranks.world_size > 1 else ""
    return output_dir / f"failed-{what}-{step}{rank}.episodes.jsonl"


@contextlib.contextmanager
def keeping_finished_episodes(output_dir: Path, step: int, total: int, ranks: Distributed,
                              phase: str = "rollout") -> Iterator[None]:
    """Around a rollout of ``total`` episodes (this rank's) in step ``step`` (its number): an error
    that stops it with finished episodes has them written (see the module's docstring) and is
    then raised as it was. A failed write is said in one line and hides nothing."""
    try:
        yield
    except Exception as exc:  # not a KeyboardInterrupt: a stop keeps nothing of its step
        finished = getattr(exc, "finished_episodes", None)
        if finished:
            finished = list(finished)
            _keep(failed_episodes_path(output_dir, step, ranks, phase), finished,
                  f"step {step}'s {phase} failed after {len(finished)} of {total} episodes", ranks)
        raise


@contextlib.contextmanager
def keeping_episodes_of_failed_samples(output_dir: Path, step: int, episodes: list, ranks: Distributed
                                       ) -> Iterator[None]:
    """Around the building of step ``step``'s training samples from this rank's ``episodes``
    (its whole finished rollout): an error there has them all written where a failed rollout's
    would go, then is raised as it was."""
    try:
        yield
    except Exception:  # not a KeyboardInterrupt: a stop keeps nothing of its step
        if episodes:
            _keep(failed_episodes_path(output_dir, step, ranks), list(episodes),
                  f"step {step}'s training samples could not be built from its {len(episodes)} episodes", ranks)
        raise


def _keep(path: Path, episodes: list, what_failed: str, ranks: Distributed) -> None:
    rank = f"rank {ranks.rank}: " if ranks.world_size > 1 else ""
    failed = f"rftgym train: {rank}{what_failed}"
    try:
        # Another rank's output directory may be on a file system where the writing rank made none.
        path.parent.mkdir(parents=True, exist_ok=True)
        write_episodes_jsonl(path, episodes)
    except Exception as write_error:  # noqa: BLE001 (whatever it is, the rollout's error comes first)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)  # no file that looks complete and is not
        reason = write_error.strerror if isinstance(write_error, OSError) and write_error.strerror else write_error
        say(f"{failed}; they could not be kept: cannot write {path} ({reason})")
        return
    say(f"{failed}; {'they are' if len(episodes) > 1 else 'it is'} in {path}")
