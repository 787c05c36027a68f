"""What keeps a run's output and settings safe: one run per output directory, no silent overwrite of
an earlier run's metrics, resumes that continue the same experiment, and settings refused before
they can fail a run at its first update."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import threading

import pytest
from support import SayAEnv, train_config

from rftgym.core.errors import ConfigError, TrainingError
from rftgym.train import TrainConfig
from rftgym.train.run_dir import OutputLock
from rftgym.train.loop import train
from rftgym.train.metrics_log import read_metrics


def config(tmp_path, name="run", **overrides) -> TrainConfig:
    """Short runs that checkpoint every step."""
    return train_config(tmp_path, name, **{"steps": 2, "tasks_per_step": 1, "group_size": 4, "max_new_tokens": 6,
                                           "minibatch_size": 8, "save_every": 1, **overrides})


def test_a_second_run_into_a_locked_output_directory_is_refused(tmp_path, make_char_policy):
    (tmp_path / "run").mkdir()
    first = OutputLock(tmp_path / "run")  # as a run in progress holds it
    assert (tmp_path / "run" / ".lock").read_text() == str(os.getpid())
    with pytest.raises(ConfigError, match=rf"another run \(process {os.getpid()}\) is writing to"):
        train(config(tmp_path), policy=make_char_policy(), make_env=SayAEnv)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was written
    first.release()
    train(config(tmp_path), policy=make_char_policy(), make_env=SayAEnv)  # free again
    OutputLock(tmp_path / "run").release()  # and the finished run let go of it


def test_an_earlier_runs_metrics_are_not_overwritten(tmp_path, make_char_policy):
    train(config(tmp_path, save_every=100, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    # A run interrupted before its first checkpoint would leave metrics and no checkpoint.
    shutil.rmtree(tmp_path / "run" / "checkpoint")
    rows = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="holds the metrics of an earlier run"):
        train(config(tmp_path), policy=make_char_policy(), make_env=SayAEnv)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == rows


def test_resume_refuses_another_experiment_before_loading_a_model(tmp_path, make_char_policy):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    for change, message in [({"algo": "rloo"}, "written with algo='grpo'; this run has algo='rloo'"),
                            ({"lora_rank": 4}, "written with lora_rank=0; this run has lora_rank=4"),
                            ({"env_id": "rftgym/MemoryQA-v0"}, "written with env_id='rftgym/VerifiableQA-v0'")]:
        # With no more steps too: the refusal comes first, not a request for more steps.
        for steps in (1, 2):
            with pytest.raises(ConfigError, match=message):
                # No policy: the check comes before the default model would load.
                train(config(tmp_path, steps=steps, **change), resume=True, make_env=SayAEnv)


def _launched_as(monkeypatch, world_size):
    """train() as rank 0 of ``world_size`` processes, with no process group (its gathers are
    rank 0's alone)."""
    from rftgym.train.distributed import Distributed

    monkeypatch.setattr(Distributed, "from_env", classmethod(lambda cls, *args, **kwargs: cls(world_size=world_size)))
    monkeypatch.setattr(Distributed, "gather_objects", lambda self, obj: [obj] * self.world_size)


def test_resume_under_another_number_of_processes_says_how_before_loading_a_model(tmp_path, make_char_policy,
                                                                                 monkeypatch):
    train(config(tmp_path, steps=1, tasks_per_step=2), policy=make_char_policy(), make_env=SayAEnv)
    _launched_as(monkeypatch, 2)
    # A model that would fail to load: the refusal comes before it, and before the step count.
    for steps in (1, 2):
        with pytest.raises(ConfigError, match=r"written by 1 process and this run has 2; resume under `torchrun "
                                              r"--nproc_per_node 1` \(or `accelerate launch --num_processes 1`\), "
                                              "or start a new run in another --output-dir"):
            train(config(tmp_path, steps=steps, tasks_per_step=2, model=str(tmp_path / "no-such-model")),
                  make_env=SayAEnv, resume=True)


def test_tasks_that_do_not_split_across_processes_are_refused_by_their_flag(tmp_path, make_char_policy,
                                                                           monkeypatch):
    from rftgym.cli.common import _flagged
    from rftgym.cli.train import _train_field_flags

    _launched_as(monkeypatch, 2)
    with pytest.raises(ConfigError, match=r"tasks_per_step \(3\) must be a multiple of the number of processes "
                                          r"\(2\)") as refused:
        train(config(tmp_path, tasks_per_step=3), policy=make_char_policy(), make_env=SayAEnv)
    assert str(_flagged(refused.value, _train_field_flags())).startswith("--tasks-per-step (3) must be a multiple")


def test_a_live_runs_directory_is_named_as_such_before_its_files_are_judged(tmp_path, make_char_policy):
    from rftgym.train.run_dir import check_output_dir

    train(config(tmp_path, save_every=100, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    shutil.rmtree(tmp_path / "run" / "checkpoint")
    live = OutputLock(tmp_path / "run")  # metrics written, no checkpoint yet, still running
    with pytest.raises(ConfigError, match="another run .* is writing to"):
        check_output_dir(tmp_path / "run", resume=False)
    live.release()
    assert (tmp_path / "run" / ".lock").read_text() == ""  # no stale process id left
    with pytest.raises(ConfigError, match="holds the metrics of an earlier run"):
        check_output_dir(tmp_path / "run", resume=False)


def test_resume_compares_settings_as_the_checkpoint_stored_them(tmp_path, make_char_policy, capsys):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    state_file = tmp_path / "run" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    # An older run's numpy int saved through json's default=str, and a model named by another path.
    state["config"].update(lora_rank="0", model="/moved/models/tiny")
    state_file.write_text(json.dumps(state))
    train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert "differ from the checkpoint's: model '/moved/models/tiny' -> None" in capsys.readouterr().err


def test_a_new_run_refuses_a_learning_curve_it_would_overwrite(tmp_path):
    from rftgym.train.run_dir import check_output_dir

    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "learning_curve.png").write_bytes(b"someone's plot")
    with pytest.raises(ConfigError, match="holds a learning_curve.png that a new run would overwrite with its own"):
        check_output_dir(tmp_path / "plots", resume=False)
    check_output_dir(tmp_path / "elsewhere", resume=False)


def test_resume_names_the_settings_a_checkpoint_misspells_or_lacks(tmp_path, make_char_policy, capsys):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    state_file = tmp_path / "run" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["group_sise"] = state["config"].pop("group_size")  # a hand edit's typo
    del state["config"]["kl_coef"]  # as from a version before the setting
    state["config"]["zzz"] = 1
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    err = capsys.readouterr().err
    assert "hold fields this version does not know, which the resume ignores: group_sise (did you mean " \
           "group_size?), zzz" in err
    # kl_coef at its default is what a version before it did: not said
    assert "lack group_size; this run has group_size=4\n" in err and "kl_coef" not in err


def test_an_evaluation_is_logged_whatever_log_every_says(tmp_path, make_char_policy):
    train(config(tmp_path, steps=4, eval_every=3, eval_episodes=2, log_every=2), policy=make_char_policy(),
          make_env=SayAEnv)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 3, 4]  # steps 2 and 4 by log_every, 3 for its evaluation
    assert [r["step"] for r in rows if "eval_reward_mean" in r] == [3, 4]


def test_resume_says_what_changed_and_where_a_longer_decay_moves_the_rate(tmp_path, make_char_policy, capsys):
    train(config(tmp_path, steps=4, lr_schedule="linear"), policy=make_char_policy(), make_env=SayAEnv)
    capsys.readouterr()
    train(config(tmp_path, steps=8, lr_schedule="linear", clip_high=0.3), policy=make_char_policy(),
          make_env=SayAEnv, resume=True)
    err = capsys.readouterr().err
    assert "differ from the checkpoint's: clip_high 0.28 -> 0.3" in err
    # Linear decay over 4 steps: step 4 is past the end (rate 0); over 8 steps it is 1e-2 * 4/8.
    assert "now spans 8 steps, not 4: the run resumes at step 5 with a rate of 0.005, where the checkpoint's " \
           "run would have had 0" in err


def test_a_metrics_line_cut_short_is_skipped_on_resume(tmp_path, make_char_policy):
    train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv)
    with (tmp_path / "run" / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 9, "rew')  # what a kill during a write leaves
    with pytest.warns(UserWarning, match=r"metrics.jsonl:3 is not a metrics row \(a line cut short\?\): .*; "
                                         r"skipped$") as caught:
        train(config(tmp_path, steps=3), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert {w.filename for w in caught if "not a metrics row" in str(w.message)} == {__file__}  # this call
    assert [row["step"] for row in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_the_checkpoint_is_readable_like_the_other_outputs(tmp_path, make_char_policy):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    assert stat.S_IMODE((tmp_path / "run" / "checkpoint").stat().st_mode) == 0o755


def test_an_output_directory_name_too_long_is_a_message(tmp_path, make_char_policy):
    with pytest.raises(ConfigError, match="cannot use the output directory .*File name too long"):
        train(config(tmp_path, "a" * 300), policy=make_char_policy(), make_env=SayAEnv)


def test_settings_the_model_cannot_honour_are_refused(tmp_path, make_char_policy):
    policy = make_char_policy()
    context = policy.model.config.max_position_embeddings
    with pytest.raises(ConfigError, match=f"max_new_tokens={context} does not fit the model's context of {context}"):
        train(config(tmp_path, max_new_tokens=context), policy=policy, make_env=SayAEnv)
    with pytest.raises(ConfigError, match=r"dtype='bfloat16', but the policy passed in holds torch.float32 weights"):
        train(config(tmp_path, dtype="bfloat16"), policy=policy, make_env=SayAEnv)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prompts_the_policy_cannot_answer_end_their_episodes_and_the_run_goes_on(tmp_path, make_char_policy):
    with pytest.warns(UserWarning, match="context_full"):
        history = train(config(tmp_path, steps=2, max_prompt_tokens=1), policy=make_char_policy(), make_env=SayAEnv)
    assert [(h["context_full_rate"], h["reward_mean"], h["samples"]) for h in history] == [(1.0, 0.0, 0)] * 2
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["context_full_rate"] == 1.0
    assert "episodes_masked_overlong" not in history[0]  # (no filter_overlong)
    roomy = config(tmp_path, "roomy", steps=1, filter_overlong=True)
    history = train(roomy, policy=make_char_policy(), make_env=SayAEnv)
    assert history[0]["context_full_rate"] == 0.0 and history[0]["sampled_tokens_mean"] > 0
    # One reply per episode: the episodes masked as cut short are the replies cut at max_new_tokens.
    episodes = roomy.tasks_per_step * roomy.group_size
    assert history[0]["turns_mean"] == 1.0 and history[0]["cut_reply_rate"] > 0
    assert history[0]["episodes_masked_overlong"] == round(history[0]["cut_reply_rate"] * episodes)


@pytest.mark.parametrize("settings, message", [
    ({"lora_rank": "8"}, "lora_rank must be an integer, got '8'"),
    ({"dcpo_segment_budget": 0.5}, "dcpo_segment_budget must be an integer"),
    ({"steps": True}, "steps must be an integer, got True"),
    ({"filter_overlong": "no"}, "filter_overlong must be True or False, got 'no'"),
    ({"compile": 1}, "compile and checkpoint_mlp must be True, False or None"),
    ({"env_id": None}, "env_id must be a non-empty string"),
    ({"model": 5}, "model must be a local model directory"),
    ({"learning_rate": 1e300}, "learning_rate must be positive and at most 1"),
    ({"weight_decay": 1e30}, "learning_rate x weight_decay at most 1"),
    ({"clip_high": 1e300}, r"clip_high must be in \[0, 1e6\]"),
    ({"clip_ratio_c": 1.0}, r"clip_ratio_c must be 0 \(off\) or in \(1, 1e6\]"),
    ({"clip_ratio_c": -3}, r"clip_ratio_c must be 0 \(off\) or in \(1, 1e6\]"),
    ({"algo": "rft", "clip_ratio_c": 3}, "no use for clip_ratio_c=3.0"),
    ({"top_p": 1e-300}, r"top_p must be in \(0, 1\] and at least 1e-30"),
    ({"temperature": 1e-300}, r"temperature must be in \[1e-06, 1e6\]"),
    # Past these the loss or the advantage scale overflows (the run stepped NaN into the weights).
    ({"kl_coef": 1e300}, r"kl_coef must be in \[0, 1e3\]"),
    ({"algo": "pcar", "pcar_lambda": 1e300}, r"pcar_lambda must be in \[0, 1e3\]"),
    ({"algo": "pcar", "pcar_delta": 1e39}, r"pcar_delta must be in \[0, 1\]"),
    ({"lora_rank": 2, "lora_alpha": 1e300}, "lora_alpha must be positive and at most 1e5"),
    ({"dist_timeout_s": 0}, r"dist_timeout_s must be a number of seconds in \(0, 1e7\]"),
    ({"dist_timeout_s": 1e300}, r"dist_timeout_s must be a number of seconds in \(0, 1e7\]"),
    ({"dist_timeout_s": "5"}, r"dist_timeout_s must be a number of seconds"),
    ({"algo": "rft", "kl_coef": 0.1}, "algo='rft' .* no use for kl_coef=0.1"),
    ({"algo": "rft", "filter_overlong": True, "kl_coef": 0.5}, "no use for kl_coef=0.5, filter_overlong=True"),
    ({"algo": "rft", "old_logprobs": "recompute"}, "no use for old_logprobs='recompute'"),
    ({"algo": "rft", "clip_high": 0.5, "filter_zero_variance": False},
     "no use for clip_high=0.5, filter_zero_variance=False"),
])
def test_config_refuses(settings, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**settings)


@pytest.mark.parametrize("settings, fields", [
    ({"learning_rate": 2.0}, ("learning_rate",)),
    ({"lora_rank": "8"}, ("lora_rank",)),
    ({"clip_low": 1.0}, ("clip_low",)),
    ({"microbatch_size": 2, "microbatch_tokens": 64}, ("microbatch_size", "microbatch_tokens")),
    ({"algo": "grpo", "pcar_delta": 0.3}, ("pcar_delta",)),
    ({"algo": "rft", "kl_coef": 0.1}, ("algo", "kl_coef")),
])
def test_config_errors_name_the_fields_at_fault(settings, fields):
    """A front end points a refusal at its own spelling of the field (rftgym train: the flag)."""
    with pytest.raises(ConfigError) as refused:
        TrainConfig(**settings)
    assert refused.value.fields == fields


@pytest.mark.parametrize("settings", [
    {"algo": "pcar", "pcar_lambda": 2.0, "pcar_delta": 0.0},
    {"algo": "dcpo", "dcpo_segment_budget": 4},
    {"lora_rank": 4, "lora_alpha": 8.0},
    {"compile": True, "compile_scope": "decoder"},
    {"compile_scope": "decoder"},  # compile unset: auto, on where it works
])
def test_mode_settings_are_taken_with_their_mode(settings):
    config = TrainConfig(**settings)
    assert all(getattr(config, name) == value for name, value in settings.items())


def test_numpy_numbers_are_taken_as_python_ones():
    import numpy as np

    config = TrainConfig(seed=np.int64(3), lora_rank=np.int32(8), learning_rate=np.float32(0.5),
                         temperature=5e-4, clip_high=1e6, weight_decay=2.0, eval_every=1,
                         eval_episodes=np.uint8(4))
    assert type(config.seed) is int and config.lora_rank == 8 and type(config.learning_rate) is float
    assert json.loads(json.dumps(config.to_dict()))["seed"] == 3  # saved as a number, not a string


def test_rft_takes_its_own_settings():
    assert TrainConfig(algo="rft", group_size=1, microbatch_tokens=512, aggregation="sequence_mean").algo == "rft"


def test_cli_interrupt_names_the_checkpoint_to_resume(tmp_path, monkeypatch, capsys):
    from rftgym import cli
    from rftgym.train import loop

    out = tmp_path / "run"

    def interrupted(config, resume=False, on_step=None):
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "state.json").write_text(json.dumps({"step": 3, "config": {}}))
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(out)]) == 130
    assert f"the checkpoint in {out}/checkpoint is at step 3; run the same command with --resume" \
           in capsys.readouterr().err


def test_cli_interrupt_under_a_launcher_is_explained_once_by_rank_0(tmp_path, monkeypatch, capsys):
    from rftgym import cli
    from rftgym.train import loop

    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text(json.dumps({"step": 3, "config": {}}))

    def interrupted(config, resume=False, on_step=None):  # a launcher's Ctrl-C reaches every rank at once
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(out)]) == 130
        said[rank] = capsys.readouterr().err
    assert "checkpoint is at step 3; run the same command with --resume" in said["0"]
    assert said["1"].strip() == "rftgym train: rank 1: interrupted, see rank 0"


def test_an_update_that_is_not_finite_stops_the_run_before_it_is_saved(tmp_path, make_char_policy, monkeypatch):
    """NaN in the loss means NaN in the weights after the optimizer step: the run stops at once, and
    the checkpoint of the last good step stays as it was."""
    import rftgym.train.loop as loop

    train(config(tmp_path, steps=1, save_every=1), policy=make_char_policy(), make_env=SayAEnv)
    saved = (tmp_path / "run" / "checkpoint" / "trainable.pt").read_bytes()
    optimise = loop.optimise
    monkeypatch.setattr(loop, "optimise", lambda *a, **k: {**optimise(*a, **k), "loss": float("nan")})
    # Named by its number: the resumed run's first step is step 2.
    with pytest.raises(TrainingError, match=r"step 2: the update's loss is nan, so the weights are no longer finite; "
                                            r"the run stops without saving them .*\(kl_coef=0, learning_rate=0.01"):
        train(config(tmp_path, steps=3, save_every=1), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert (tmp_path / "run" / "checkpoint" / "trainable.pt").read_bytes() == saved
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 1


@pytest.mark.parametrize("step", [-5, True, 2.0, None])
def test_a_checkpoint_step_that_is_not_a_count_is_refused_and_the_metrics_kept(tmp_path, make_char_policy, step):
    train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv)
    state_file = tmp_path / "run" / "checkpoint" / "state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "step": step}))
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"state.json is not a checkpoint state .* an int >= 0"):
        train(config(tmp_path, steps=4), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_random_states_that_are_not_a_runs_are_named(tmp_path, make_char_policy):
    import torch

    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    folder = tmp_path / "run" / "checkpoint"
    torch.save({}, folder / "rng.pt")
    _record_checksums(folder)  # a file saved whole, but not a run's
    with pytest.raises(ConfigError, match=r"rng.pt does not hold a run's random states"):
        train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)


def _record_checksums(folder, drop=False):
    import hashlib

    state = json.loads((folder / "state.json").read_text())
    state["files"] = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in state["files"]}
    if drop:  # as a checkpoint saved before checksums were kept
        del state["files"]
    (folder / "state.json").write_text(json.dumps(state))


@pytest.mark.parametrize("name", ["trainable.pt", "optimizer.pt", "rng.pt"])
def test_a_checkpoint_file_damaged_after_its_save_is_refused_not_trained_on(tmp_path, make_char_policy, name):
    from rftgym.core.errors import ModelLoadError
    from rftgym.train.export import _read_weights

    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    folder = tmp_path / "run" / "checkpoint"
    state = json.loads((folder / "state.json").read_text())
    assert sorted(state["files"]) == ["optimizer.pt", "rng.pt", "trainable.pt"]
    data = bytearray((folder / name).read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])  # it still loads, wrong
    (folder / name).write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"checkpoint/{name} is not the file its save wrote: its sha256 .* changed "
                                          r"or damaged since .* left as it is"):
        train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    if name == "trainable.pt":  # export reads only the weights, and checks them
        with pytest.raises(ModelLoadError, match="is not the file its save wrote"):
            _read_weights(tmp_path / "run")
    # a checkpoint written before checksums were kept is not checked
    shutil.rmtree(tmp_path / "run")
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    _record_checksums(folder, drop=True)
    train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert json.loads((folder / "state.json").read_text())["step"] == 2


def test_a_checkpoint_that_cannot_be_written_is_a_message_and_the_last_one_is_kept(tmp_path, make_char_policy,
                                                                                 monkeypatch):
    import torch

    import rftgym.train.checkpoint as checkpoint

    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())

    def full_disk(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 24256 vs 24144")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(TrainingError, match=r"cannot write the checkpoint of step 2 in .* MiB free there\); the "
                                            r"previous checkpoint, if any, is kept. Free space, then run it again "
                                            r"with --resume, which continues from the last checkpoint at step 1"):
        train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    monkeypatch.setattr(checkpoint.torch, "save", torch.serialization.save)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before  # no staging folder left
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 1


def test_metrics_are_rewritten_whole_or_not_at_all(tmp_path, monkeypatch):
    from rftgym.core import files
    from rftgym.train import metrics_log

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\n{"step": 2, "loss": 2}\n')

    def failing_replace(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "replace", failing_replace)
    log = metrics_log.MetricsLog(tmp_path, resume_step=1)  # the rerun step's row goes with the first result
    with pytest.raises(TrainingError, match=r"cannot write .*metrics.jsonl \(No space left on device; [\d,]+ MiB free"):
        log.write(2, {"loss": 3})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1}\n{"step": 2, "loss": 2}\n'
    assert not list(tmp_path.glob(".*metrics*")) and not list(tmp_path.glob("*.tmp"))  # no half-written copy


@pytest.mark.parametrize("history, settings, reason", [
    ([{"samples": 0, "groups_kept": 0, "context_full_rate": 0.0}] * 2, {},
     "in every group all episodes had the same reward"),
    ([{"samples": 0, "groups_kept": 0, "context_full_rate": 1.0}], {}, "every episode ran out of context"),
    ([{"samples": 0, "groups_kept": 0, "context_full_rate": 0.0}], {"algo": "rft", "group_size": 1},
     "no episode succeeded"),
    ([{"samples": 0, "groups_kept": 2, "context_full_rate": 0.0}], {"filter_overlong": True},
     "no episode gave a sample to train on (filter_overlong masked the episodes cut short)"),
])
def test_a_run_that_never_updated_says_why(history, settings, reason):
    from rftgym.train.loop import untrained_run

    assert reason in untrained_run(history, TrainConfig(**settings))
    # Samples are counted over every rank: one that trained (this rank's own loss None) is enough.
    assert untrained_run(history + [{"samples": 3, "loss": None}], TrainConfig(**settings)) is None


def test_rft_without_successes_warns_at_the_end(tmp_path, make_char_policy):
    class NeverEnv(SayAEnv):
        def step(self, action):
            context, reward, terminated, truncated, _ = super().step(action)
            return context, reward, terminated, truncated, {"success": False}

    with pytest.warns(UserWarning, match=r"no step of this run updated the model \(steps 1 to 2\): no episode "
                                         r"succeeded") as caught:
        train(config(tmp_path, steps=2, algo="rft", group_size=2), policy=make_char_policy(), make_env=NeverEnv)
    # It names this call of train(), not a line of the trainer's own.
    assert {w.filename for w in caught if "updated the model" in str(w.message)} == {__file__}
    # A resumed run names its own steps as the run counts them.
    with pytest.warns(UserWarning, match=r"no step of this run updated the model \(step 3\): no episode succeeded"):
        train(config(tmp_path, steps=3, algo="rft", group_size=2), policy=make_char_policy(), make_env=NeverEnv,
              resume=True)


@pytest.mark.parametrize("name, make", [("metrics.jsonl", "dir"), ("learning_curve.png", "dir"),
                                        ("tensorboard", "file"), ("checkpoint", "file")])
def test_an_output_of_the_wrong_kind_is_named_before_the_run(tmp_path, name, make):
    from rftgym.train.run_dir import check_output_dir

    (tmp_path / name).mkdir() if make == "dir" else (tmp_path / name).write_text("x")
    with pytest.raises(ConfigError, match=rf"{name} is a {'directory' if make == 'dir' else 'file'}, where the run "
                                          "writes its .*; move it away or choose another output directory"):
        check_output_dir(tmp_path, resume=False)


def test_cli_sigterm_stops_like_an_interrupt_and_says_what_to_do(tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM: the run stops through its own cleanup and names the checkpoint."""
    import signal

    from rftgym import cli
    from rftgym.train import loop

    out = tmp_path / "run"

    def terminated(config, resume=False, on_step=None):
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "state.json").write_text(json.dumps({"step": 2, "config": {}}))
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(loop, "train", terminated)
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(out)]) == 143
    assert f"terminated (SIGTERM): the checkpoint in {out}/checkpoint is at step 2; run the same command with " \
           "--resume" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # put back as it was


def test_cli_interrupt_before_anything_was_written_says_to_run_again(tmp_path, monkeypatch, capsys):
    from rftgym import cli
    from rftgym.train import loop

    def interrupted(config, resume=False, on_step=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "run")]) == 130
    assert "interrupted before the first checkpoint, so there is nothing to resume; run the same command to start " \
           "again" in capsys.readouterr().err


def test_a_file_system_that_cannot_fsync_still_gets_its_checkpoint(tmp_path, make_char_policy, monkeypatch):
    import errno

    import rftgym.train.checkpoint as checkpoint

    def refused(descriptor):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(checkpoint.os, "fsync", refused)
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 1


def test_a_crash_between_the_renames_of_a_save_resumes_from_the_previous_checkpoint(tmp_path, make_char_policy):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    run = tmp_path / "run"
    (run / "checkpoint").rename(run / ".checkpoint-old")  # the old one moved aside, the new one not yet in
    history = train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert [h["step"] for h in history] == [2]
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 2
    assert not (run / ".checkpoint-old").exists()  # no longer the last whole checkpoint: removed


def test_a_staging_folder_a_killed_run_left_is_removed_at_the_next_save(tmp_path, make_char_policy):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    (tmp_path / "run" / ".checkpoint-x1y2z3").mkdir()  # what a SIGKILL during a save leaves
    (tmp_path / "run" / ".checkpoint-x1y2z3" / "trainable.pt").write_bytes(b"half")
    train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert not any(p.name.startswith(".checkpoint-") for p in (tmp_path / "run").iterdir())


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_a_launcher_rank_0_prints_the_runs_table(tmp_path, monkeypatch, capsys, rank):
    from rftgym import cli
    from rftgym.train import loop

    row = {"step": 1, "reward_mean": 0.5, "success_rate": 0.5, "loss": 0.1, "learning_rate": 1e-5,
           "step_seconds": 1.0}
    monkeypatch.setattr(loop, "train", lambda config, resume=False, on_step=None: [row])
    monkeypatch.setenv("RANK", rank)
    assert cli.main(["train", "rftgym/VerifiableQA-v0", "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert ("metrics: " in out and "reward" in out) is (rank == "0")


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_metrics_that_cannot_be_written_stop_the_run_with_a_message(tmp_path, make_char_policy, monkeypatch):
    from rftgym.train import metrics_log

    real_open = metrics_log.Path.open

    def full_disk_for_metrics(self, *args, **kwargs):
        if self.name == "metrics.jsonl" and args[:1] == ("a",):
            _no_space()
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(metrics_log.Path, "open", full_disk_for_metrics)
    # Before the first checkpoint there is nothing to resume: the message says to run it again.
    with pytest.raises(TrainingError, match=r"cannot write .*metrics.jsonl at step 1 \(No space left on device; "
                                            r"[\d,]+ MiB free there\).*then start the run again in another "
                                            r"--output-dir \(no checkpoint has been written yet, so there is nothing "
                                            r"to resume\)"):
        train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)


def test_tensorboard_logs_that_cannot_be_written_stop_the_run_with_a_message(tmp_path, make_char_policy,
                                                                             monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr(SummaryWriter, "flush", _no_space)  # what its writer thread's error looks like here
    before = set(threading.enumerate())
    with pytest.raises(TrainingError, match=r"cannot write .*tensorboard at step 1 \(No space left on device"):
        train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    # The broken writer is closed too: its thread wrote on into the folder the stopped run removed.
    left = [t for t in set(threading.enumerate()) - before if "tensorboard" in type(t).__module__]
    assert not left


def test_a_learning_curve_that_cannot_be_written_is_a_warning(tmp_path, make_char_policy, monkeypatch):
    from matplotlib.figure import Figure
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr(Figure, "savefig", _no_space)
    close = SummaryWriter.close

    def close_then_fail(writer):  # its thread is stopped all the same
        close(writer)
        _no_space()

    monkeypatch.setattr(SummaryWriter, "close", close_then_fail)
    with pytest.warns(UserWarning, match=r"could not write .*learning_curve.png \(No space left on device\); the "
                                         r"metrics it would plot are in .*metrics.jsonl") as caught:
        history = train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    assert len(history) == 1 and (tmp_path / "run" / "checkpoint" / "state.json").is_file()
    said = {str(w.message): w.filename for w in caught if "could not" in str(w.message)}
    assert any("could not finish the TensorBoard logs" in message for message in said), list(said)
    assert set(said.values()) == {__file__}  # this call of train(), not a line of the trainer's own


def test_a_run_unlocked_and_without_tensorboard_or_matplotlib_warns_at_the_call_of_train(tmp_path, make_char_policy,
                                                                                        monkeypatch):
    import errno
    import fcntl

    flock = fcntl.flock

    def no_exclusive_lock(handle, operation):  # as on some NFS and Lustre mounts
        if operation == fcntl.LOCK_EX | fcntl.LOCK_NB:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return flock(handle, operation)

    monkeypatch.setattr(fcntl, "flock", no_exclusive_lock)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as when they are not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.warns(UserWarning) as caught:
        train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    said = {str(w.message): w.filename for w in caught}
    for warning in ("nothing stops a second run from writing to the same output directory",
                    "tensorboard is not installed", "matplotlib is not installed"):
        assert [file for message, file in said.items() if warning in message] == [__file__], (warning, said)


def test_a_lock_file_that_cannot_be_written_is_named_and_not_taken_for_bad_input(tmp_path, monkeypatch):
    from rftgym.train import run_dir

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def __getattr__(self, name):  # the text is buffered; flushing it fails, and so does closing
            return _no_space if name in ("flush", "close") else getattr(self.handle, name)

    handles = []

    def full_disk_open(*args, **kwargs):
        handles.append(open(*args, **kwargs))
        return FullDisk(handles[-1])

    monkeypatch.setattr(run_dir, "open", full_disk_open, raising=False)
    with pytest.raises(TrainingError, match=r"cannot write the lock file .*\.lock \(No space left on device\)"):
        OutputLock(tmp_path)
    handles[0].close()


def test_an_incomplete_checkpoint_says_it_cannot_be_resumed(tmp_path, make_char_policy):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    (tmp_path / "run" / "checkpoint" / "state.json").unlink()
    with pytest.raises(ConfigError, match=r"holds an incomplete checkpoint \(no checkpoint/state.json.*cannot be "
                                          r"resumed.*move .*checkpoint away"):
        train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv)
    with pytest.raises(ConfigError, match="nothing to resume"):
        train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)


def test_a_resume_names_changed_settings_but_not_a_model_path_spelled_another_way(tmp_path, monkeypatch):
    from rftgym.train.checkpoint import resume_changes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "m")
    saved = {"model": "./m", "seed": 0, "temperature": "1.0", "steps": 3}
    assert resume_changes(saved, {"model": "m", "seed": 0, "temperature": 1.0, "steps": 5}) == []
    assert resume_changes(saved, {"model": "m/", "seed": 1, "temperature": 0.7, "steps": 5}) == ["seed", "temperature"]
    assert resume_changes(saved, {"model": "other", "seed": 0, "temperature": 1.0}) == ["model"]
    # the default model by its two names: one model
    assert resume_changes({"model": None}, {"model": "default"}) == []
    assert resume_changes({"model": "default"}, {"model": None}) == []
    # an env named with the module that registers it, or without (as a run from Python names it): one env
    assert resume_changes({"env_id": "mine/X-v0"}, {"env_id": "my_envs:mine/X-v0"}) == []
    with pytest.raises(ConfigError, match="was written with env_id='mine/X-v0'"):
        resume_changes({"env_id": "mine/X-v0"}, {"env_id": "my_envs:mine/Y-v0"})
    # state.json holds a tuple option as a list: the same setting
    options = {"env_kwargs": {"difficulties": [1, 2]}}
    assert resume_changes(options, {"env_kwargs": {"difficulties": (1, 2)}}) == []
    assert resume_changes(options, {"env_kwargs": {"difficulties": (1, 3)}}) == ["env_kwargs"]
    # Absolute paths to one place are one directory; a relative one is not compared with an
    # absolute one (it was relative to the directory the first run started in).
    absolute = {"model": str(tmp_path / "m")}
    assert resume_changes(absolute, {"model": str(tmp_path / "link")}) == []
    assert resume_changes(saved, absolute) == ["model"]
    # ... unless it is where the checkpoint's model was loaded from (a resume without --model
    # takes that directory for a relative saved path)
    assert resume_changes(saved, absolute, loaded_from=str(tmp_path / "link")) == []
    assert resume_changes(saved, {"model": str(tmp_path / "other")}, loaded_from=str(tmp_path / "m")) == ["model"]


def test_only_values_state_json_cannot_hold_are_said_to_be_kept_as_text(tmp_path):
    from rftgym.train.checkpoint import kept_as_text

    # state.json is written as Python's json writes it: NaN and a tuple are read back as saved.
    assert not any(kept_as_text(value) for value in (float("nan"), (1, 2), {"a": [None, True]}, "x"))
    assert kept_as_text({"a"}) and kept_as_text(tmp_path) and kept_as_text(object())


def test_a_resume_naming_no_model_loads_the_directory_its_checkpoint_loaded(tmp_path):
    from rftgym.train.run_dir import resumed_model

    (tmp_path / "m").mkdir()
    state = {"step": 1, "config": {"model": "m"}, "base_model_path": str(tmp_path / "m")}
    assert resumed_model(state, "m") == resumed_model(state, None) == str(tmp_path / "m")
    # the default model (no directory): the setting as saved
    assert resumed_model({**state, "base_model_path": None}, None) is None
    # moved away: the setting where it names a directory here, else an error that says where it was
    moved = {**state, "base_model_path": str(tmp_path / "gone")}
    assert resumed_model(moved, str(tmp_path / "m")) == str(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"base model was loaded from .*gone, which is no directory now .*\(--model DIR"):
        resumed_model(moved, "nowhere")


def test_a_run_stopped_before_any_result_leaves_its_output_directory_as_it_was(tmp_path, make_char_policy):
    policy = make_char_policy()
    context = policy.model.config.max_position_embeddings
    # A new directory (and the folder above it) is removed whole.
    with pytest.raises(ConfigError, match=f"max_new_tokens={context} does not fit"):
        train(config(tmp_path, "new/run", max_new_tokens=context), policy=policy, make_env=SayAEnv)
    assert not (tmp_path / "new").exists()

    # One that was there keeps what it held, an earlier run's lock file too; only the run's own go.
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    OutputLock(run).release()  # the (empty) lock file an earlier run left
    before = sorted(p.name for p in run.iterdir())

    class BreaksInTheFirstStep(SayAEnv):  # a crash after the metrics and TensorBoard logs were opened
        def step(self, action):
            raise RuntimeError("the env broke")

    with pytest.raises(Exception, match="the env broke"):
        train(config(tmp_path), policy=policy, make_env=BreaksInTheFirstStep)
    assert sorted(p.name for p in run.iterdir()) == before == [".lock", "notes.txt"]


def test_a_run_that_wrote_a_result_keeps_its_outputs_when_it_stops(tmp_path, make_char_policy, monkeypatch):
    import rftgym.train.loop as loop

    build_samples, steps = loop.build_samples, []

    def fails_in_the_second_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("the second step broke")
        return build_samples(*args, **kwargs)

    monkeypatch.setattr(loop, "build_samples", fails_in_the_second_step)
    with pytest.raises(RuntimeError, match="the second step broke"):
        train(config(tmp_path, steps=3, save_every=100), policy=make_char_policy(), make_env=SayAEnv)
    run = tmp_path / "run"
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1]  # a result: nothing is removed
    assert (run / "tensorboard").is_dir() and any((run / "tensorboard").iterdir()) and (run / ".lock").exists()


def test_a_stopped_runs_writers_are_closed_before_its_files_are_removed(tmp_path):
    # TensorBoard writes from a thread of its own: removing its folder first left that thread
    # writing into a removed path (FileNotFoundError in a thread, after the run had stopped).
    from rftgym.train.run_dir import RunFootprint

    out = tmp_path / "run"
    footprint = RunFootprint(out)
    events = out / "tensorboard" / "events.out"
    events.parent.mkdir(parents=True)
    events.write_text("x")
    seen = []

    class Writer:
        def close(self):
            seen.append(events.exists())

    class Broken:
        def close(self):
            raise OSError("its thread failed")

    footprint.close_before_removing(Broken())  # (one that cannot close keeps nothing behind either)
    footprint.close_before_removing(Writer())
    footprint.remove_unless_results()
    assert seen == [True] and not out.exists()


def test_a_resumed_metrics_log_keeps_the_checkpoints_steps_and_redoes_the_rest(tmp_path):
    """Rows go by step number (1-based): a resume from the checkpoint at step 2 keeps steps 1 and 2
    (in metrics.jsonl and TensorBoard) and replaces step 3, the one it runs again."""
    from rftgym.train.metrics_log import MetricsLog

    EventAccumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator").EventAccumulator

    first = MetricsLog(tmp_path)
    for step in (1, 2, 3):
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = MetricsLog(tmp_path, resume_step=2)
    resumed.write(3, {"loss": 30.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_a_resume_that_fails_before_its_first_result_keeps_the_rows_of_the_steps_it_would_rerun(
        tmp_path, make_char_policy):
    """A run checkpointed at step 2 logged step 3 before it was killed; a resume that fails in its
    first step leaves metrics.jsonl as it found it, and one that goes on logs each step once."""
    class Killed(Exception):
        pass

    def kill_after_step_3(row):
        if row["step"] == 3:
            raise Killed

    with pytest.raises(Killed):
        train(config(tmp_path, steps=4, save_every=2), policy=make_char_policy(), make_env=SayAEnv,
              on_step=kill_after_step_3)
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3]
    before = metrics.read_bytes()

    class BrokenEnv(SayAEnv):
        def reset(self, *, seed=None, options=None):
            raise RuntimeError("the env's service went away")

    with pytest.raises(Exception, match="service went away"):
        train(config(tmp_path, steps=4, save_every=2), policy=make_char_policy(), make_env=BrokenEnv, resume=True)
    assert metrics.read_bytes() == before  # step 3's row is the killed run's only record of it
    train(config(tmp_path, steps=4, save_every=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]  # step 3 once: the rerun's
