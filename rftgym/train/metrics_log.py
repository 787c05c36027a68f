"""Training metrics: JSONL (always), TensorBoard (when installed) and a learning-curve PNG."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

from ..core.errors import TrainingError, warn_caller
from ..core.files import replace_text
from ..core.records import write_episodes_jsonl
from .run_dir import METRICS_FILE, TENSORBOARD_DIR, how_to_continue

# What the learning curve plots, where a run's rows hold it: the rewards, then what explains them
# (format errors; the policy's entropy and its distance from the reference), then the loss (near 0
# by construction for one epoch of group-normalized advantages).
CURVE_KEYS = ("reward_mean", "eval_reward_mean", "success_rate", "eval_success_rate", "format_error_rate", "entropy",
              "kl_ref", "loss")


def cannot_write(what: Path, exc: BaseException, output_dir: Path, step: int | None = None) -> TrainingError:
    """The error for an output the run cannot write (a full disk, a read-only file), saying how
    much room is left there and how the run goes on (resumed, or started again before its first
    checkpoint)."""
    folder = what if what.is_dir() else what.parent
    try:
        free = f"; {shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"
    except OSError:
        free = ""
    when = f" at step {step}" if step is not None else ""
    detail = getattr(exc, "strerror", None) or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return TrainingError(f"cannot write {what}{when} ({detail}{free}). Free space (or make it writable), "
                         f"{how_to_continue(output_dir)}")


# A row that stands for several steps (--log-every above 1) keeps these at the logged step's
# value (the state the run is in, as TRL logs its learning rate), not their mean.
STATE_KEYS = ("learning_rate", "epoch")


def window_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics row that stands for ``rows`` (the steps since the last logged row, oldest
    first; their ``step`` keys are not read): each number the mean over the steps that report it
    (TRL averages its logging window), except ``*_min`` (the least), ``*_max`` (the greatest) and
    :data:`STATE_KEYS` (the last step's); a metric no step reports a number for is None; other
    values are the last step's. One row is itself."""
    if len(rows) == 1:
        return {k: v for k, v in rows[0].items() if k != "step"}
    keys = list(dict.fromkeys(k for row in rows for k in row if k != "step"))
    merged = {}
    for key in keys:
        values = [row[key] for row in rows if key in row]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if key in STATE_KEYS or not numbers or len(numbers) < len([v for v in values if v is not None]):
            merged[key] = values[-1]   # (a state, no number, or text among them: the last step's)
        elif key.endswith("_min"):
            merged[key] = min(numbers)
        elif key.endswith("_max"):
            merged[key] = max(numbers)
        else:
            merged[key] = sum(numbers) / len(numbers)
    return merged


EPISODES_DIR = "episodes"   # episodes/step-<step>.jsonl: a logged step's first --log-episodes episodes


def write_step_episodes(output_dir: Path, step: int, episodes: list) -> None:
    """``episodes`` of step ``step`` (its number) to ``episodes/step-<step>.jsonl``, whole or not at
    all (written beside it, then renamed; a resumed run that runs the step again replaces it)."""
    folder = output_dir / EPISODES_DIR
    path = folder / f"step-{step}.jsonl"
    staging = folder / f".step-{step}.jsonl.partial"
    try:
        folder.mkdir(exist_ok=True)
        write_episodes_jsonl(staging, episodes, compressed=False)
        staging.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            staging.unlink()
        raise cannot_write(path, exc, output_dir, step) from exc


class MetricsLog:
    """The run's metrics, a JSON row per logged step in ``metrics.jsonl`` and TensorBoard scalars,
    each under the step's number (1 for the first step, TensorBoard's global step too). A run
    resumed from a checkpoint at step ``resume_step`` (the steps done) keeps the rows of steps 1
    to ``resume_step``: the later rows (of steps it runs again) go when it writes its first result
    (a row, or a checkpoint: :meth:`drop_rerun_rows`), so that a resume that fails before that
    leaves them as they were. A file it cannot write stops the run with a :class:`TrainingError`
    that says so."""

    def __init__(self, output_dir: Path, resume_step: int = 0):
        self.output_dir = output_dir
        self.path = output_dir / METRICS_FILE
        self._tb_dir = output_dir / TENSORBOARD_DIR
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            # On resume, rows of steps that will be run again are dropped (each step appears once),
            # and so is a line cut short (which a row appended after it would join).
            self._kept: str | None = None
            self.last_kept_step = 0  # the last step a kept row stands for (0: none)
            if self.path.exists():
                rows = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
                self.last_kept_step = max((r["step"] for r in rows), default=0)
                kept = "".join(json.dumps(r) + "\n" for r in rows)
                if kept != self.path.read_text(encoding="utf-8", errors="replace"):
                    self._kept = kept
        except OSError as exc:
            raise cannot_write(self.path, exc, output_dir) from exc
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warn_caller("tensorboard is not installed; metrics go to metrics.jsonl only "
                        "(pip install 'rftgym[train]' adds it)")
            return
        try:
            # (TensorBoard drops the events from purge_step on: those of the steps run again)
            self._tb = SummaryWriter(str(self._tb_dir), purge_step=resume_step + 1)
        except OSError as exc:
            raise cannot_write(self._tb_dir, exc, output_dir) from exc

    def drop_rerun_rows(self) -> None:
        """Drop the rows of the steps this resumed run runs again; once, before its first result."""
        if self._kept is None:
            return
        try:
            replace_text(self.path, self._kept)
        except OSError as exc:
            raise cannot_write(self.path, exc, self.output_dir) from exc
        self._kept = None

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Log step number ``step``'s (1-based) metrics."""
        self.drop_rerun_rows()
        row = {"step": step, **metrics}
        try:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
        except OSError as exc:
            raise cannot_write(self.path, exc, self.output_dir, step) from exc
        if self._tb is not None:
            try:
                for key, value in metrics.items():
                    if isinstance(value, (int, float)):
                        self._tb.add_scalar(key, value, step)
                self._tb.flush()
            except Exception as exc:  # its writer thread's error comes back here, of any type
                # Broken: closed now, so that its thread stops, and quietly, since closing it may raise
                # the same error again.
                broken, self._tb = self._tb, None
                with contextlib.suppress(Exception):
                    broken.close()
                raise cannot_write(self._tb_dir, exc, self.output_dir, step) from exc

    def close(self) -> None:
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except Exception as exc:  # the metrics are in metrics.jsonl whatever happens here
                warn_caller(f"could not finish the TensorBoard logs in {self._tb_dir} ({exc}); the metrics are "
                            f"all in {self.path}")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file. A line that is not a JSON row with an int ``step`` (the half
    line a kill or a full disk leaves at the end) is skipped with a warning that names it."""
    rows, skipped = [], []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
        else:
            skipped.append((number, line))
    if skipped:
        number, line = skipped[0]
        warn_caller(f"{path}:{number} is not a metrics row (a line cut short?): {line[:80]!r}; skipped"
                    + (f", with {len(skipped) - 1} more such lines" if len(skipped) > 1 else ""))
    return rows


def plot_learning_curve(metrics_path: Path, png_path: Path,
                        keys: tuple[str, ...] = CURVE_KEYS) -> Path | None:
    """Plot the given metrics against the step; returns None when matplotlib is missing."""
    try:
        figure = learning_curve_figure(read_metrics(metrics_path), keys)
    except ImportError:
        warn_caller("matplotlib is not installed; no learning-curve PNG (pip install 'rftgym[train]')")
        return None
    if figure is None:
        return None
    try:
        figure.savefig(png_path, dpi=100)
    except OSError as exc:  # the run's work is saved already: a missing picture is not worth failing it
        warn_caller(f"could not write {png_path} ({exc.strerror or exc}); the metrics it would plot are in "
                    f"{metrics_path}")
        return None
    return png_path


def learning_curve_figure(rows: list[dict[str, Any]], keys: tuple[str, ...] = CURVE_KEYS):
    """A matplotlib Figure with one panel per metric of ``keys`` that ``rows`` hold, against the
    step (whole-number ticks); None when they hold none. Made without pyplot, so drawing it
    neither switches the caller's backend (a notebook's inline plots go on working) nor touches
    pyplot's global figure list (it is freed with the object, and safe to make off the main thread)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    present = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not present:
        return None
    figure = Figure(figsize=(6, 2.2 * len(present)))
    axes = figure.subplots(len(present), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, present):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 1.5
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    return figure
