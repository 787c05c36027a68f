"""Checkpoints are read and checked once: what a check before any model loads read (the state,
the random states, a verified checksum) is what the load uses, not read again; and a setting a
resume may not change is refused by its field."""

from __future__ import annotations

import collections
import hashlib
import json
import time
from pathlib import Path

import pytest
import torch
from support import SayAEnv, make_char_policy, train_config

import rftgym.train.checkpoint as checkpoint
from rftgym.cli import main
from rftgym.core.errors import ConfigError
from rftgym.train.checkpoint import resume_changes, verify_checkpoint_file
from rftgym.train.config import TrainConfig
from rftgym.train.loop import train

ENV_ID = "rftgym/VerifiableQA-v0"
pytestmark = pytest.mark.filterwarnings("ignore:no step of this run updated the model")


def short(tmp_path, **overrides) -> TrainConfig:
    return train_config(tmp_path, "run", **{"steps": 1, "tasks_per_step": 1, "group_size": 2, "max_new_tokens": 4,
                                            "minibatch_size": 2, **overrides})


@pytest.fixture
def run_from_base(tmp_path):
    """A base model saved as a directory and a one-step run from it (its output directory)."""
    base = tmp_path / "base"
    policy = make_char_policy()
    policy.model.save_pretrained(base)
    policy.tokenizer.save_pretrained(base)
    train(short(tmp_path, model=str(base)), policy=policy, make_env=SayAEnv)
    return tmp_path / "run"


@pytest.fixture
def reads(monkeypatch):
    """Counts of what is read: ``state.json`` reads, sha256 passes and torch.load calls, by file."""
    counts = collections.Counter()
    file_digest, read_text, load = hashlib.file_digest, Path.read_text, torch.load

    def counting_digest(handle, *args, **kwargs):
        counts[f"sha256 {Path(handle.name).name}"] += 1
        return file_digest(handle, *args, **kwargs)

    def counting_read_text(self, *args, **kwargs):
        if self.name == "state.json":
            counts["read state.json"] += 1
        return read_text(self, *args, **kwargs)

    def counting_load(source, *args, **kwargs):
        counts[f"load {Path(str(source)).name}"] += 1
        return load(source, *args, **kwargs)

    monkeypatch.setattr(hashlib, "file_digest", counting_digest)
    monkeypatch.setattr(Path, "read_text", counting_read_text)
    monkeypatch.setattr(torch, "load", counting_load)
    return counts


@pytest.fixture
def settled(monkeypatch):
    """Files count as settled however new (the run's files here were written a moment ago), and
    no file is remembered as verified from another test."""
    monkeypatch.setattr(checkpoint, "SETTLED_NS", -10**18, raising=False)
    monkeypatch.setattr(checkpoint, "_verified", {}, raising=False)


@pytest.mark.parametrize("key, value", [("env_id", "rftgym/CodeTCG-v0"), ("algo", "rft"), ("lora_rank", 4),
                                        ("lora_alpha", 64.0)])  # alpha / rank scales what the adapters add
def test_a_setting_a_resume_may_not_change_is_refused_by_its_field(key, value):
    saved = TrainConfig(env_id=ENV_ID).to_dict()
    with pytest.raises(ConfigError, match=f"was written with {key}=") as refused:
        resume_changes(saved, {**saved, key: value})
    assert refused.value.fields == (key,)


def test_a_resume_reads_the_state_and_random_states_once(tmp_path, reads):
    train(short(tmp_path), policy=make_char_policy(), make_env=SayAEnv)
    reads.clear()
    train(short(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert reads["load rng.pt"] == 1 and reads["sha256 rng.pt"] == 1
    assert reads["read state.json"] == 1
    for name in ("trainable.pt", "optimizer.pt"):  # each verified, then loaded, once
        assert reads[f"load {name}"] == 1 and reads[f"sha256 {name}"] == 1
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["step"] == 2


@pytest.mark.filterwarnings("ignore:a prompt is longer than the policy answers")
def test_a_run_given_as_model_has_its_weights_hashed_once(tmp_path, run_from_base, reads, settled):
    assert main(["eval", ENV_ID, "--agent", "hf", "--model", str(run_from_base), "--device", "cpu",
                 "--episodes", "1", "--max-new-tokens", "2", "--out", str(tmp_path / "eval.jsonl")]) == 0
    # checked before any model loads, and not hashed again where it loads
    assert reads["sha256 trainable.pt"] == 1 and reads["load trainable.pt"] == 1


def test_export_reads_the_state_once_for_each_thing_it_checks(tmp_path, run_from_base, reads, settled):
    assert main(["export", str(run_from_base), str(tmp_path / "model")]) == 0
    # Once to check the run before any model loads, once as its model is rebuilt, and once after the
    # weights are read, to know that no save replaced them meanwhile.
    assert reads["read state.json"] == 3
    assert reads["sha256 trainable.pt"] == 1 and reads["load trainable.pt"] == 1
    assert json.loads((tmp_path / "model" / "rftgym_run.json").read_text())["step"] == 1


def test_a_file_verified_is_read_again_once_it_changes(tmp_path, run_from_base, monkeypatch):
    monkeypatch.setattr(checkpoint, "_verified", {})
    folder = run_from_base / "checkpoint"
    weights = folder / "trainable.pt"

    def damage() -> None:
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF  # the same size, written in place
        weights.write_bytes(bytes(data))

    # Just written, it is not remembered: a write within the same tick of the file clock would
    # leave its times as they were.
    verify_checkpoint_file(folder, "trainable.pt")
    assert checkpoint._verified == {}
    original = weights.read_bytes()
    damage()
    with pytest.raises(ConfigError, match="trainable.pt is not the file its save wrote"):
        verify_checkpoint_file(folder, "trainable.pt")
    # Settled, it is remembered, until it is written to.
    weights.write_bytes(original)
    monkeypatch.setattr(checkpoint, "SETTLED_NS", -10**18)  # as if written long ago
    verify_checkpoint_file(folder, "trainable.pt")
    assert len(checkpoint._verified) == 1
    time.sleep(0.05)  # past the file clock's tick
    damage()
    with pytest.raises(ConfigError, match="trainable.pt is not the file its save wrote"):
        verify_checkpoint_file(folder, "trainable.pt")


@pytest.mark.parametrize("name", ["trainable.pt", "optimizer.pt"])
@pytest.mark.parametrize("checksums", [True, False])
def test_a_resume_refuses_a_damaged_file_before_any_model_loads(tmp_path, monkeypatch, name, checksums):
    from rftgym.agents.hf_policy import HFPolicy

    train(short(tmp_path), policy=make_char_policy(), make_env=SayAEnv)
    folder = tmp_path / "run" / "checkpoint"
    if not checksums:  # as saved before rftgym kept them
        state = json.loads((folder / "state.json").read_text())
        del state["files"]
        (folder / "state.json").write_text(json.dumps(state))
    whole = (folder / name).read_bytes()
    (folder / name).write_bytes(whole[: len(whole) // 2])

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(no_model))
    said = "is not the file its save wrote" if checksums else "is damaged: it is not a whole file"
    with pytest.raises(ConfigError, match=f"{name} {said}.*restore the file from a copy"):
        train(short(tmp_path, steps=2), make_env=SayAEnv, resume=True)
    assert (folder / name).read_bytes() == whole[: len(whole) // 2]  # left as it is


def test_a_resume_refuses_a_checkpoint_file_it_cannot_read_naming_it(tmp_path, monkeypatch):
    train(short(tmp_path), policy=make_char_policy(), make_env=SayAEnv)
    monkeypatch.setattr(checkpoint, "_verified", {})

    file_digest = hashlib.file_digest

    def disk_error_in(name):
        def digest(handle, *args, **kwargs):
            if Path(handle.name).name == name:
                raise OSError(5, "Input/output error")
            return file_digest(handle, *args, **kwargs)
        return digest

    for name in ("rng.pt", "optimizer.pt"):  # read for the world size first; the rest after the quick checks
        monkeypatch.setattr(hashlib, "file_digest", disk_error_in(name))
        with pytest.raises(ConfigError, match=rf"{name} cannot be read \(Input/output error\); make it readable"):
            train(short(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)


def test_a_resume_refuses_a_changed_setting_before_reading_the_files_whole(tmp_path, reads):
    train(short(tmp_path), policy=make_char_policy(), make_env=SayAEnv)
    reads.clear()
    with pytest.raises(ConfigError, match="written with algo='grpo'"):
        train(short(tmp_path, steps=2, algo="rft"), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert not [key for key in reads if key.startswith("sha256")]


def test_ctrl_c_while_a_checkpoint_is_written_stops_once_it_is_whole(tmp_path, monkeypatch, capsys):
    """An interrupt inside torch.save's writer would come out as a RuntimeError (taken for a full
    disk); held until the save is done, it stops the run with the new checkpoint whole."""
    import os
    import signal

    save_hashed = checkpoint._save_hashed

    def interrupted_midway(value, path):
        if path.name == "optimizer.pt":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the file is being written
        return save_hashed(value, path)

    monkeypatch.setattr(checkpoint, "_save_hashed", interrupted_midway)
    state = {"weights": {"w": torch.ones(2)}, "optimizer": {"state": {}, "param_groups": []}}
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(tmp_path, state=state, step=3, rng_states={"ranks": [{}]}, config={})
    assert "finishing the checkpoint being written, then stopping" in capsys.readouterr().err
    saved = json.loads((tmp_path / "checkpoint" / "state.json").read_text())
    assert saved["step"] == 3 and set(saved["files"]) == {"trainable.pt", "optimizer.pt", "rng.pt"}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def _saved_model(folder: Path, seed: int = 0, **save_options) -> Path:
    policy = make_char_policy(seed=seed)
    policy.model.save_pretrained(folder, **save_options)
    policy.tokenizer.save_pretrained(folder)
    return folder


def test_a_resume_on_other_base_weights_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from rftgym.agents.hf_policy import HFPolicy

    base, other = _saved_model(tmp_path / "base"), _saved_model(tmp_path / "other", seed=1)
    train(short(tmp_path, model=str(base)), make_env=SayAEnv)
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["base_model_from_files"] is True
    # What the check after the load says (a policy passed in has no files to read first) ...
    with pytest.raises(ConfigError, match="trained from other base weights") as after_the_load:
        train(short(tmp_path, steps=2, model=str(other)), policy=HFPolicy.from_pretrained(str(other), device="cpu"),
              make_env=SayAEnv, resume=True)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    # ... is said before the model loads, word for word.
    monkeypatch.setattr(HFPolicy, "from_pretrained", classmethod(no_model))
    with pytest.raises(ConfigError) as at_once:
        train(short(tmp_path, steps=2, model=str(other)), make_env=SayAEnv, resume=True)
    assert str(at_once.value) == str(after_the_load.value)
    monkeypatch.undo()
    # The model it was trained from resumes (from a moved copy too: the same weights).
    history = train(short(tmp_path, steps=2, model=str(base)), make_env=SayAEnv, resume=True)
    assert [h["step"] for h in history] == [2]
    moved = base.rename(tmp_path / "moved")
    assert [h["step"] for h in train(short(tmp_path, steps=3, model=str(moved)), make_env=SayAEnv,
                                     resume=True)] == [3]


def test_a_checkpoint_whose_model_files_did_not_give_its_fingerprint_is_checked_after_the_load(tmp_path,
                                                                                              monkeypatch):
    from rftgym.agents.hf_policy import HFPolicy

    base, other = _saved_model(tmp_path / "base"), _saved_model(tmp_path / "other", seed=1)
    train(short(tmp_path, model=str(base)), make_env=SayAEnv)
    state_file = tmp_path / "run" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    del state["base_model_from_files"]  # as saved before rftgym kept it
    state_file.write_text(json.dumps(state))
    loaded, load = [], HFPolicy.from_pretrained
    monkeypatch.setattr(HFPolicy, "from_pretrained",
                        classmethod(lambda cls, *args, **kwargs: loaded.append(args) or load(*args, **kwargs)))
    with pytest.raises(ConfigError, match="trained from other base weights"):
        train(short(tmp_path, steps=2, model=str(other)), make_env=SayAEnv, resume=True)
    assert loaded  # refused after the load, as before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("save_options", [{}, {"max_shard_size": "20KB"}], ids=["one file", "shards"])
def test_the_files_give_the_fingerprint_of_the_model_they_load(tmp_path, dtype, save_options):
    from rftgym.agents.model_loading import load_model_and_tokenizer
    from rftgym.train.base_model import base_fingerprint, files_fingerprint

    folder = _saved_model(tmp_path / "base", **save_options)
    assert (folder / "model.safetensors.index.json").is_file() == bool(save_options)
    model, _ = load_model_and_tokenizer(str(folder), device="cpu", dtype=dtype)
    assert files_fingerprint(str(folder), dtype) == base_fingerprint(model)


def test_files_that_cannot_give_the_fingerprint_give_none(tmp_path, run_from_base):
    from rftgym.train.base_model import files_fingerprint

    assert files_fingerprint(str(tmp_path / "no-such-model"), "float32") is None
    assert files_fingerprint(str(run_from_base), "float32") is None  # a run's trained weights: merged as it loads
    folder = _saved_model(tmp_path / "plain")
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "num_hidden_layers": 3}))  # a layer the files lack
    assert files_fingerprint(str(folder), "float32") is None


@pytest.mark.parametrize("master_weights", [False, True], ids=["adamw", "float32-masters"])
def test_a_resume_steps_with_its_own_weight_decay_and_the_saved_moments(tmp_path, master_weights):
    from rftgym.train.checkpoint import checkpoint_state, load_checkpoint, save_checkpoint
    from rftgym.train.speed import make_optimizer

    def setup(weight_decay: float):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 2).to(torch.bfloat16 if master_weights else torch.float32)
        return model, make_optimizer(model.parameters(), lr=0.1, weight_decay=weight_decay)

    model, optimizer = setup(0.0)
    model(torch.ones(1, 2, dtype=model.weight.dtype)).sum().backward()
    optimizer.step()
    moments = [optimizer.state_dict()["state"][i]["exp_avg"].clone() for i in (0, 1)]
    save_checkpoint(tmp_path, state=checkpoint_state(model, optimizer), step=1, rng_states={"ranks": []},
                    config=TrainConfig().to_dict())
    resumed, optimizer = setup(0.1)
    load_checkpoint(tmp_path, model=resumed, optimizer=optimizer)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1]  # the resume's, not the saved 0.0
    for index, moment in enumerate(moments):
        assert torch.equal(optimizer.state_dict()["state"][index]["exp_avg"], moment)


def _save(folder: Path, step: int, keep: int) -> None:
    state = {"weights": {"w": torch.full((2,), float(step))}, "optimizer": {"state": {}, "param_groups": []}}
    checkpoint.save_checkpoint(folder, state=state, step=step, rng_states={"ranks": [{}]}, config={}, keep=keep)


def _folders(folder: Path) -> dict[str, int]:
    """The checkpoints in ``folder`` by name, and their steps."""
    return {path.name: json.loads((path / "state.json").read_text())["step"]
            for path in sorted(folder.iterdir()) if (path / "state.json").is_file()}


@pytest.mark.parametrize("keep, kept", [(1, {}), (2, {"checkpoint-6": 6}), (3, {"checkpoint-4": 4, "checkpoint-6": 6}),
                                        (0, {"checkpoint-2": 2, "checkpoint-4": 4, "checkpoint-6": 6})])
def test_a_save_keeps_the_earlier_checkpoints_the_run_keeps(tmp_path, keep, kept):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step, keep)
    assert _folders(tmp_path) == {"checkpoint": 8, **kept}


def test_a_checkpoint_a_crash_left_between_or_after_a_saves_renames_is_kept(tmp_path):
    from rftgym.train.run_dir import checkpoint_path

    _save(tmp_path, 2, keep=3)
    _save(tmp_path, 4, keep=3)
    # A crash between the renames of step 6's save: the last checkpoint lies under its old name.
    (tmp_path / "checkpoint").rename(tmp_path / ".checkpoint-old")
    assert checkpoint_path(tmp_path) == tmp_path / ".checkpoint-old"
    _save(tmp_path, 6, keep=3)
    assert _folders(tmp_path) == {"checkpoint": 6, "checkpoint-2": 2, "checkpoint-4": 4}
    # A crash after the renames of step 8's save, before step 6's checkpoint took its kept name.
    _save(tmp_path, 8, keep=3)
    (tmp_path / "checkpoint-6").rename(tmp_path / ".checkpoint-old")
    _save(tmp_path, 10, keep=3)
    assert _folders(tmp_path) == {"checkpoint": 10, "checkpoint-6": 6, "checkpoint-8": 8}


def test_folders_the_run_did_not_keep_are_never_removed(tmp_path):
    """A copy of a checkpoint under a kept one's name and another tool's checkpoint-N (a Hugging
    Face Trainer's) stay, at the default keep=1 too; a checkpoint that cannot take its kept name
    is removed with a warning, and the run goes on saving."""
    import shutil

    _save(tmp_path, 2, keep=1)
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "checkpoint-1")  # a copy by hand
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-3" / "config.json").write_text("{}")  # another tool's
    _save(tmp_path, 4, keep=1)
    _save(tmp_path, 6, keep=2)
    assert _folders(tmp_path) == {"checkpoint": 6, "checkpoint-1": 2, "checkpoint-4": 4}
    assert (tmp_path / "checkpoint-3" / "config.json").is_file()
    (tmp_path / "checkpoint-6").write_text("a file")  # where step 6 would be kept
    with pytest.warns(UserWarning, match=r"the checkpoint of step 6 cannot be kept as .*checkpoint-6 \(a file or "
                                         "folder of that name, not one the run kept, is there\); it is removed"):
        _save(tmp_path, 8, keep=0)
    _save(tmp_path, 10, keep=0)
    assert _folders(tmp_path) == {"checkpoint": 10, "checkpoint-1": 2, "checkpoint-4": 4, "checkpoint-8": 8}
    assert (tmp_path / "checkpoint-6").read_text() == "a file"


def test_a_new_run_is_refused_where_earlier_checkpoints_of_a_run_lie(tmp_path):
    from rftgym.train.run_dir import check_output_dir

    _save(tmp_path, 2, keep=0)
    _save(tmp_path, 4, keep=0)
    (tmp_path / "checkpoint").rename(tmp_path / "moved")
    with pytest.raises(ConfigError, match=r"holds earlier checkpoints of a run \(checkpoint-2\) that a new run would "
                                          "mix with its own"):
        check_output_dir(tmp_path, resume=False)
    with pytest.raises(ConfigError, match="nothing to resume"):
        check_output_dir(tmp_path, resume=True)


def test_a_run_directory_without_a_checkpoint_yet_is_named_as_such(tmp_path, make_char_policy):
    from support import SayAEnv, train_config

    from rftgym.agents.model_loading import resolve_model_dir
    from rftgym.core.errors import ModelLoadError
    from rftgym.train.loop import train

    seen = {}

    def look(row):   # after the first of two steps, before the run's first checkpoint (after its last)
        if row["step"] == 1:
            with pytest.raises(ModelLoadError) as refused:
                resolve_model_dir(str(tmp_path / "run"))
            seen["said"] = str(refused.value)

    train(train_config(tmp_path, "run", steps=2, save_every=100), policy=make_char_policy(), make_env=SayAEnv,
          on_step=look)
    assert "is a training run's output directory with no checkpoint yet" in seen["said"]
    assert resolve_model_dir(str(tmp_path / "run")) == tmp_path / "run"   # its checkpoint after the last step
    with pytest.raises(ModelLoadError, match="'.*elsewhere': no such directory"):
        resolve_model_dir(str(tmp_path / "elsewhere"))


def test_another_tools_checkpoint_folders_do_not_make_a_run_directory(tmp_path):
    from rftgym.agents.model_loading import resolve_model_dir
    from rftgym.core.errors import ModelLoadError
    from rftgym.train.run_dir import check_output_dir

    trainer_output = tmp_path / "outputs"
    (trainer_output / "checkpoint-500").mkdir(parents=True)
    (trainer_output / "checkpoint-500" / "config.json").write_text("{}")
    check_output_dir(trainer_output, resume=False)  # a new run may write there
    with pytest.raises(ModelLoadError, match="is not a local Hugging Face model directory"):
        resolve_model_dir(str(trainer_output))
