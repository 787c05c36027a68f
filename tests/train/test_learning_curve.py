"""The learning curve: drawn without pyplot (the caller's matplotlib backend and figures are left
alone), one panel per metric the rows hold, whole-number step ticks."""

from __future__ import annotations

import json

import pytest

matplotlib = pytest.importorskip("matplotlib")

from rftgym.train.metrics_log import learning_curve_figure, plot_learning_curve  # noqa: E402


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_drawing_the_curve_leaves_the_callers_backend_and_figures_alone(tmp_path):
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")  # as a notebook's inline backend: not the Agg a PNG is drawn with
    try:
        mine = plt.figure()
        metrics = write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "reward_mean": 0.1, "loss": 0.5},
                                                          {"step": 2, "reward_mean": 0.3, "loss": 0.4}])
        assert plot_learning_curve(metrics, tmp_path / "curve.png") == tmp_path / "curve.png"
        assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.get_backend() == "svg"
        assert plt.get_fignums() == [mine.number]  # no figure of the trainer's left open in pyplot
        plt.close(mine)
    finally:
        plt.switch_backend(before)


def test_one_panel_per_metric_present_and_steps_ticked_as_whole_numbers():
    rows = [{"step": 1, "reward_mean": 0.1, "loss": 0.5, "eval_reward_mean": None, "entropy": 2.0},
            {"step": 2, "reward_mean": 0.2, "loss": None, "entropy": 1.5},
            {"step": 3, "reward_mean": 0.4, "loss": 0.3, "eval_reward_mean": 0.25, "entropy": 1.0}]
    figure = learning_curve_figure(rows)
    axes = figure.get_axes()
    # no success_rate, format_error_rate or kl_ref in these rows: no panel
    assert [ax.get_ylabel() for ax in axes] == ["reward_mean", "eval_reward_mean", "entropy", "loss"]
    # Each panel plots the steps that have a value, None left out.
    assert [list(ax.lines[0].get_xdata()) for ax in axes] == [[1, 2, 3], [3], [1, 2, 3], [1, 3]]
    figure.canvas.draw()
    ticks = axes[-1].get_xticks()
    assert len(ticks) and all(float(t).is_integer() for t in ticks), ticks  # no step 1.5 on a 3-step run
    assert axes[-1].get_xlabel() == "step"


def test_rows_without_any_curve_metric_draw_no_picture(tmp_path):
    metrics = write_rows(tmp_path / "metrics.jsonl", [{"step": 1, "loss": None}])
    assert learning_curve_figure([{"step": 1, "loss": None}]) is None
    assert plot_learning_curve(metrics, tmp_path / "curve.png") is None and not (tmp_path / "curve.png").exists()
