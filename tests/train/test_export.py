"""A training run's model comes back as a plain Hugging Face model: evaluated from its output
directory, or exported with its tokenizer for any tool to load."""

from __future__ import annotations

import json

import pytest
import torch
from support import SayAEnv, make_char_policy, train_config

from rftgym.cli import main
from rftgym.core.errors import ConfigError, ModelLoadError
from rftgym.train.export import export, load_trained
from rftgym.train.loop import train

PROBE = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def trained_run(tmp_path, **settings):
    """A base model saved as a directory, a short run from it, and the trained policy."""
    base = tmp_path / "base"
    policy = make_char_policy()
    policy.model.save_pretrained(base)
    policy.tokenizer.save_pretrained(base)
    before = logits(policy.model)
    train(train_config(tmp_path, "run", steps=2, model=str(base), **settings), policy=policy, make_env=SayAEnv)
    assert not torch.allclose(logits(policy.model), before)  # the run changed the model
    return tmp_path / "run", policy


def test_a_policy_loaded_from_a_directory_is_named_as_the_runs_base(tmp_path, capsys):
    """train(config, policy=HFPolicy.from_pretrained(DIR)) without config.model: the checkpoint names
    DIR, so the run exports and loads without base_model=."""
    from rftgym.agents.hf_policy import HFPolicy

    base = tmp_path / "base"
    made = make_char_policy()
    made.model.save_pretrained(base)
    made.tokenizer.save_pretrained(base)
    policy = HFPolicy.from_pretrained(str(base), device="cpu")
    assert policy.source_dir == str(base.resolve())
    # A model setting naming another directory would be recorded as the run's base: refused.
    with pytest.raises(ConfigError, match=r"model='.*elsewhere' names another directory than the policy passed in "
                                          r"was loaded from \(.*base\)"):
        train(train_config(tmp_path, "refused", steps=1, model=str(tmp_path / "elsewhere")), policy=policy,
              make_env=SayAEnv)
    train(train_config(tmp_path, "run", steps=1), policy=policy, make_env=SayAEnv)
    assert policy.source_dir is None  # trained in place: another run from it names no directory
    model, _ = load_trained(tmp_path / "run", device="cpu")
    torch.testing.assert_close(logits(model), logits(policy.model), atol=1e-5, rtol=1e-5)
    # A resume given no policy and no model loads DIR (not the default model, which it would refuse).
    capsys.readouterr()
    rows = train(train_config(tmp_path, "run", steps=2), make_env=SayAEnv, resume=True)
    assert [row["step"] for row in rows] == [2]
    said = capsys.readouterr().err
    assert "differ from the checkpoint" not in said  # the same base, named two ways
    assert f"resuming the run in {tmp_path / 'run'} from its checkpoint at step 1: steps 2 to 2" in said
    with pytest.raises(ConfigError, match="was trained from other base weights than --model default holds"):
        train(train_config(tmp_path, "run", steps=3), policy=make_char_policy(seed=1), make_env=SayAEnv, resume=True)
    # Another run from the policy trained in place: warned that no directory holds its weights.
    with pytest.warns(UserWarning, match=r"trained in place by the run in .*run: no model directory holds its "
                                         r"weights.* \(rftgym export .*run DIR\)"):
        train(train_config(tmp_path, "second", steps=1), policy=policy, make_env=SayAEnv)


def test_a_run_of_the_default_model_passed_in_names_the_default_model_as_its_base(tmp_path, monkeypatch):
    # HFPolicy.from_pretrained() keeps no directory for the default model; its run is not "from memory".
    import rftgym.agents.model_loading as model_loading
    from rftgym.agents.hf_policy import HFPolicy

    made = make_char_policy()
    monkeypatch.setattr(model_loading, "load_model_and_tokenizer", lambda *a, **k: (made.model, made.tokenizer))
    policy = HFPolicy.from_pretrained(device="cpu")
    assert policy.default_model and policy.source_dir is None
    train(train_config(tmp_path, "run", steps=1), policy=policy, make_env=SayAEnv)
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert "base_model_in_memory" not in state and not policy.default_model  # trained in place since
    assert not HFPolicy(made.model, made.tokenizer).default_model


def test_a_run_of_a_policy_from_memory_asks_for_its_base_by_name(tmp_path):
    """train(config, policy=...) with a policy built in memory and no config.model: the checkpoint
    names no base, and export, load and resume say so, where they blamed the default model."""
    policy, other = make_char_policy(), make_char_policy(seed=1)
    for model, folder in ((policy, "base"), (other, "other")):
        model.model.save_pretrained(tmp_path / folder)
        model.tokenizer.save_pretrained(tmp_path / folder)
    train(train_config(tmp_path, "run", steps=1), policy=policy, make_env=SayAEnv)
    with pytest.raises(ModelLoadError, match=r"trained a policy passed in from memory .* name that directory: "
                                             r"load_trained\(RUN, base_model=DIR\)"):
        load_trained(tmp_path / "run", device="cpu")
    model, _ = load_trained(tmp_path / "run", device="cpu", base_model=tmp_path / "base")
    torch.testing.assert_close(logits(model), logits(policy.model), atol=1e-5, rtol=1e-5)
    # A model directory is no run: what loads it is named; a device is checked before anything loads.
    with pytest.raises(ModelLoadError, match=r"holds no complete checkpoint. It is a model directory \(config.json\), "
                                          r"not a training run: HFPolicy.from_pretrained\(DIR\)"):
        load_trained(tmp_path / "base", device="cpu")
    with pytest.raises(ConfigError, match="device='tpu': not a torch device"):
        load_trained(tmp_path / "run", device="tpu", base_model=tmp_path / "base")
    model, _ = load_trained(tmp_path / "run", device=torch.device("cpu"), base_model=tmp_path / "base")  # as torch takes it
    with pytest.raises(ConfigError, match=r"trained from a policy passed in from memory .* these base weights "
                                          r"\(fingerprint .*\) are not that policy's. Resume with the same policy"):
        train(train_config(tmp_path, "run", steps=2, model=str(tmp_path / "other")), make_env=SayAEnv, resume=True)


@pytest.mark.parametrize("settings", [{}, {"lora_rank": 4}], ids=["full", "lora"])
def test_the_trained_model_is_rebuilt_from_the_run(tmp_path, settings):
    run, policy = trained_run(tmp_path, **settings)
    model, tokenizer = load_trained(run, device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"  # LoRA merged: a plain model
    torch.testing.assert_close(logits(model), logits(policy.model), atol=1e-5, rtol=1e-5)
    assert tokenizer("ab")["input_ids"] == policy.tokenizer("ab")["input_ids"]


def test_a_run_saved_with_settings_it_never_read_still_loads(tmp_path):
    """A run saved before eval_episodes without eval_every (or min_lr_ratio with the constant
    schedule, or a microbatch over the minibatch) was refused still exports: those settings were
    never read, and go back to their defaults when the run is loaded."""
    from rftgym.train.config import TrainConfig, UnreadSetting

    run, policy = trained_run(tmp_path)
    state_path = next(run.rglob("state.json"))
    state = json.loads(state_path.read_text())
    state["config"].update(eval_episodes=8, min_lr_ratio=0.5, microbatch_size=999, a_field_of_the_future=1)
    state_path.write_text(json.dumps(state))
    with pytest.raises(UnreadSetting):
        TrainConfig.from_dict({k: v for k, v in state["config"].items() if k != "a_field_of_the_future"})
    loaded = TrainConfig.from_saved(state["config"])
    assert (loaded.eval_episodes, loaded.min_lr_ratio, loaded.microbatch_size) == (32, 0.0, 0)
    model, _ = load_trained(run, device="cpu")
    torch.testing.assert_close(logits(model), logits(policy.model), atol=1e-5, rtol=1e-5)


def test_an_exported_run_loads_anywhere_and_evaluates(tmp_path):
    from rftgym.agents.hf_policy import HFPolicy

    run, policy = trained_run(tmp_path, lora_rank=4)
    out = export(run, tmp_path / "exported")
    loaded = HFPolicy.from_pretrained(str(out), device="cpu")
    torch.testing.assert_close(logits(loaded.model), logits(policy.model), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "rftgym_run.json").read_text())["step"] == 2
    with pytest.raises(ConfigError, match="is a directory that is not empty"):
        export(run, out)
    # The command line: export, and evaluate a run's directory as it is.
    assert main(["export", str(run), str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "config.json").is_file()
    with pytest.raises(SystemExit) as refused:  # bad input: exit status 2, with a message
        main(["export", str(tmp_path / "base"), str(tmp_path / "nothing")])
    assert refused.value.code == 2
    episodes = tmp_path / "episodes.jsonl"
    assert main(["eval", "rftgym/VerifiableQA-v0", "--agent", "hf", "--model", str(run), "--episodes", "1",
                 "--max-new-tokens", "4", "--out", str(episodes)]) == 0
    assert episodes.is_file()


@pytest.mark.filterwarnings("ignore:a prompt is longer than the policy answers")
def test_an_evaluation_of_a_run_says_which_step_and_keeps_its_settings(tmp_path, capsys):
    """The episodes of a run's directory, of its checkpoint and of its export were byte for byte
    alike, and nothing said which model, at which step, wrote them."""
    run, _ = trained_run(tmp_path)
    trained_on = json.loads((run / "checkpoint" / "state.json").read_text())["config"]["env_id"]
    capsys.readouterr()
    episodes = tmp_path / "episodes.jsonl"
    assert main(["eval", "rftgym/CodeTCG-v0", "--model", str(run), "--episodes", "1", "--out", str(episodes),
                 "--env-arg", "dataset=generated"]) == 0
    err = capsys.readouterr().err
    assert f"--model: the run in {run} at step 2 (trained on {trained_on})" in err
    assert f"note: the run trained on {trained_on}; this evaluation is of rftgym/CodeTCG-v0" in err
    assert ("note: the run trained with --max-new-tokens 8, and this evaluation gives each reply 256 (eval's "
            "default); add --max-new-tokens 8") in err
    settings = json.loads((tmp_path / "episodes.jsonl.settings.json").read_text())
    assert settings["model"] == str(run.resolve()) and settings["model_step"] == 2
    assert settings["agent"] == "hf" and len(settings["weights"]) == 16 and settings["max_new_tokens"] == 256
    assert not (tmp_path / "episodes.jsonl.partial.json").exists()
    # On its env, as it trained: no note.
    assert main(["eval", trained_on, "--model", str(run), "--episodes", "1", "--max-new-tokens", "8",
                 "--out", str(episodes)]) == 0
    assert "note:" not in capsys.readouterr().err
    # A run that trained with stop strings: evaluated without them, it is said how to give them.
    state_file = run / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["stop"] = ["</answer>", "a b"]
    state_file.write_text(json.dumps(state))
    assert main(["eval", trained_on, "--model", str(run), "--episodes", "1", "--max-new-tokens", "8",
                 "--out", str(episodes)]) == 0
    assert ("note: the run trained with replies ending at '</answer>', 'a b', and this evaluation's do not; add "
            "--stop '</answer>' --stop 'a b' to evaluate it as it trained") in capsys.readouterr().err
    assert main(["eval", trained_on, "--model", str(run), "--episodes", "1", "--max-new-tokens", "8",
                 "--stop", "</answer>", "--out", str(episodes)]) == 0
    assert "note:" not in capsys.readouterr().err


def test_a_run_whose_base_model_changed_is_not_rebuilt(tmp_path):
    run, _ = trained_run(tmp_path)
    other = make_char_policy(seed=1)  # the same shapes, other weights, where the base model was
    other.model.save_pretrained(tmp_path / "base")
    with pytest.raises(ModelLoadError, match="are not the base weights the run in .* was trained from .*--base-model DIR"):
        load_trained(run)


def test_an_export_on_other_base_weights_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """Where the run's base model's files gave its fingerprint (the run loaded the model itself),
    a --base-model with other weights is refused from its files, with the words of the check
    after the load; the model it was trained from exports."""
    import rftgym.agents.model_loading as model_loading
    import rftgym.train.export as export_module

    for name, seed in (("base", 0), ("other", 1)):
        policy = make_char_policy(seed=seed)
        policy.model.save_pretrained(tmp_path / name)
        policy.tokenizer.save_pretrained(tmp_path / name)
    train(train_config(tmp_path, "run", steps=1, model=str(tmp_path / "base")), make_env=SayAEnv)
    run = tmp_path / "run"
    assert json.loads((run / "checkpoint" / "state.json").read_text())["base_model_from_files"] is True
    # What the check after the load says (with the files' reading taken away) ...
    with monkeypatch.context() as patched:
        patched.setattr(export_module, "files_fingerprint", lambda *args: None)
        with pytest.raises(ModelLoadError, match="are not the base weights the run in") as after_the_load:
            export(run, tmp_path / "out", base_model=tmp_path / "other")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    # ... is said before the model loads, word for word.
    with monkeypatch.context() as patched:
        patched.setattr(model_loading, "load_model_and_tokenizer", no_model)
        with pytest.raises(ModelLoadError) as at_once:
            export(run, tmp_path / "out", base_model=tmp_path / "other")
    assert str(at_once.value) == str(after_the_load.value)
    assert not (tmp_path / "out").exists()
    # On the command line the --base-model given is at fault: a usage error naming it (exit 2).
    with pytest.raises(SystemExit) as refused:
        main(["export", str(run), str(tmp_path / "out"), "--base-model", str(tmp_path / "other")])
    assert refused.value.code == 2
    moved = (tmp_path / "base").rename(tmp_path / "moved")
    assert (export(run, tmp_path / "out", base_model=moved) / "config.json").is_file()


def test_a_run_is_rebuilt_from_where_it_loaded_its_base_or_where_it_moved(tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    policy = make_char_policy()
    policy.model.save_pretrained(tmp_path / "base")
    policy.tokenizer.save_pretrained(tmp_path / "base")
    # --model given relative to the directory the run started in
    train(train_config(tmp_path, "run", steps=1, model="base"), policy=policy, make_env=SayAEnv)
    monkeypatch.chdir(tmp_path / "run")  # elsewhere: the run kept the absolute path
    torch.testing.assert_close(logits(load_trained(tmp_path / "run")[0]), logits(policy.model))
    # and a resume with the same config (model="base", no such directory here) loads it from there
    assert [row["step"] for row in train(train_config(tmp_path, "run", steps=2, model="base"), make_env=SayAEnv,
                                         resume=True)] == [2]
    shutil.move(tmp_path / "base", tmp_path / "moved")
    with pytest.raises(ModelLoadError, match="the base model of the run in .* cannot be loaded from .* --base-model DIR"):
        load_trained(tmp_path / "run")
    out = export(tmp_path / "run", tmp_path / "out", base_model=tmp_path / "moved")
    assert (out / "config.json").is_file()


def test_a_bfloat16_lora_run_keeps_its_whole_update_and_comes_back_trainable(tmp_path):
    from peft.tuners.lora import LoraLayer

    base = tmp_path / "base"
    policy = make_char_policy()
    policy.model.save_pretrained(base)
    policy.tokenizer.save_pretrained(base)
    policy.model.to(torch.bfloat16)
    # Small steps: merged into bfloat16 weights, such an update was mostly rounded away.
    train(train_config(tmp_path, "run", steps=2, model=str(base), dtype="bfloat16", lora_rank=4,
                       learning_rate=1e-4), policy=policy, make_env=SayAEnv)
    model, _ = load_trained(tmp_path / "run", device="cpu")
    assert next(model.parameters()).dtype == torch.float32  # merged in float32, and kept so
    merged = dict(model.named_parameters())
    layers = [(name, module) for name, module in policy.model.named_modules() if isinstance(module, LoraLayer)]
    assert layers
    for name, layer in layers:
        delta = layer.get_delta_weight("default").float()  # what the adapters add, as trained
        assert delta.abs().max() > 0
        weight = merged[name.removeprefix("base_model.model.") + ".weight"]
        torch.testing.assert_close(weight - layer.base_layer.weight.float(), delta, atol=1e-6, rtol=1e-3)
    assert all(p.requires_grad for p in model.parameters())  # a whole model to fine-tune further


def test_an_export_checks_where_it_goes_before_loading_anything(tmp_path):
    run, _ = trained_run(tmp_path)
    (tmp_path / "afile").write_text("x")
    for out, message in ((run / "checkpoint" / "model", "inside the run's checkpoint area"),
                         (run / ".checkpoint-mine", "inside the run's checkpoint area"),
                         (tmp_path / "afile" / "sub", "cannot be made: .* is a file"),
                         (tmp_path / "afile", "afile is a file; the model is written to a directory"),
                         (run, "is a directory that is not empty")):
        with pytest.raises(ConfigError, match=message):
            export(run, out)
    from rftgym.cli import main

    # a base model that is not there is a usage error (2), as --model is for eval and train
    with pytest.raises(SystemExit) as stopped:
        main(["export", str(run), str(tmp_path / "new"), "--base-model", str(tmp_path / "nowhere")])
    assert stopped.value.code == 2
    out = export(run, run / "model")  # beside the checkpoint is fine
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}  # readable by a model server


def test_a_checkpoint_without_its_weights_is_named(tmp_path):
    run, _ = trained_run(tmp_path)
    (run / "checkpoint" / "trainable.pt").unlink()
    with pytest.raises(ModelLoadError, match="holds no trainable.pt .* the checkpoint is incomplete"):
        load_trained(run)
    (run / "checkpoint" / "state.json").unlink()
    with pytest.raises(ModelLoadError, match="checkpoint is incomplete"):
        from rftgym.agents.hf_policy import HFPolicy

        HFPolicy.from_pretrained(str(run))


def test_an_export_into_the_run_directory_survives_the_runs_next_save(tmp_path, monkeypatch):
    """A run still going saves a checkpoint while its model is exported into its own directory: the
    save clears its half-written staging folders, and the export's is none of them."""
    import transformers

    from rftgym.train import checkpoint

    run, policy = trained_run(tmp_path)
    real_save = transformers.PreTrainedTokenizerBase.save_pretrained

    def save_meanwhile(tokenizer, folder, *args, **kwargs):
        state = json.loads((run / "checkpoint" / "state.json").read_text())
        checkpoint.save_checkpoint(run, state={"weights": {}, "optimizer": {}}, step=state["step"], rng_states={},
                                   config=state["config"])
        return real_save(tokenizer, folder, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", save_meanwhile)
    out = export(run, run / "checkpoint-best")
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))


def test_an_export_whose_files_went_missing_is_an_error_not_an_empty_model(tmp_path, monkeypatch):
    import shutil

    import transformers

    from rftgym.core.errors import TrainingError

    run, _ = trained_run(tmp_path)
    real_save = transformers.PreTrainedTokenizerBase.save_pretrained

    def removed_meanwhile(tokenizer, folder, *args, **kwargs):
        shutil.rmtree(folder)  # as another program might
        return real_save(tokenizer, folder, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", removed_meanwhile)
    with pytest.raises(TrainingError, match=r"went missing while it wrote them .*nothing was exported"):
        export(run, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_an_export_that_cannot_be_written_is_an_error_naming_the_folder(tmp_path, monkeypatch, capsys):
    import errno

    import transformers

    run, _ = trained_run(tmp_path)

    def disk_full(model, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    assert main(["export", str(run), str(tmp_path / "model")]) == 1
    said = capsys.readouterr().err
    assert f"cannot write the export in {tmp_path} (No space left on device; " in said and "Traceback" not in said
    assert "nothing was exported" in said and not (tmp_path / "model").exists()
    assert not list(tmp_path.glob(".*model*"))  # no staging folder left behind


def test_a_lora_runs_adapters_export_alone_and_load_onto_their_base_with_peft(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run, policy = trained_run(tmp_path, lora_rank=4)
    assert main(["export", str(run), str(tmp_path / "adapters"), "--adapter-only"]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    out = tmp_path / "adapters"
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "config.json").exists()  # no whole model: the base stays where it is
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert json.loads((out / "rftgym_run.json").read_text())["adapter_only"] is True
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(out)).eval()
    merged, _ = load_trained(run, device="cpu")
    torch.testing.assert_close(logits(adapted), logits(merged), atol=1e-5, rtol=1e-5)
    # Adapters on another run's model would name a base no loader reads: refused, saying what to do.
    # (Training from a run's directory is warned of: that run may train on under it.)
    with pytest.warns(UserWarning, match=r"the base model is the training run in .*run, at the step its checkpoint "
                                         r"holds now; .*export it first \(rftgym export .*run DIR\)"):
        train(train_config(tmp_path, "on-run", steps=1, model=str(run), lora_rank=4), make_env=SayAEnv)
    with pytest.raises(ConfigError, match=r"is another run .*export that run first \(rftgym export .*run DIR\)"):
        export(tmp_path / "on-run", tmp_path / "refused", adapter_only=True)
    assert not (tmp_path / "refused").exists()
    # A run that trained the whole model has no adapters to export alone.
    full, _ = trained_run(tmp_path / "full")
    with pytest.raises(ConfigError, match=r"trained the whole model \(lora_rank 0\), so it has no adapters"):
        export(full, tmp_path / "none", adapter_only=True)
    assert not (tmp_path / "none").exists()


def test_an_earlier_checkpoint_a_run_keeps_is_its_model_at_that_step(tmp_path):
    base = tmp_path / "base"
    policy = make_char_policy()
    policy.model.save_pretrained(base)
    policy.tokenizer.save_pretrained(base)
    after = {}
    train(train_config(tmp_path, "run", steps=3, save_every=1, keep_checkpoints=0, model=str(base)), policy=policy,
          make_env=SayAEnv, on_step=lambda row: after.__setitem__(row["step"], logits(policy.model)))
    run = tmp_path / "run"
    assert not torch.allclose(after[1], after[3])
    first, _ = load_trained(run / "checkpoint-1", device="cpu")
    torch.testing.assert_close(logits(first), after[1], atol=1e-5, rtol=1e-5)
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "model-2")]) == 0
    assert json.loads((tmp_path / "model-2" / "rftgym_run.json").read_text())["step"] == 2
    import transformers

    second = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model-2")
    torch.testing.assert_close(logits(second), after[2], atol=1e-5, rtol=1e-5)
    # An earlier checkpoint is removed once the run keeps fewer: no export goes there.
    with pytest.raises(ConfigError, match="inside the run's checkpoint area"):
        export(run / "checkpoint-2", run / "checkpoint-1" / "model")


def test_a_run_loaded_in_bfloat16_is_the_exported_model_loaded_so(tmp_path):
    """A run's directory as --model in bfloat16 (CUDA's default) is cast as from_pretrained loads a
    model: computed buffers (the rotary inv_freq) stay float32, so both give the same log-probs."""
    from rftgym.agents.model_loading import load_model_and_tokenizer

    run, _ = trained_run(tmp_path)
    export(run, tmp_path / "model")
    from_run, _ = load_model_and_tokenizer(str(run), device="cpu", dtype="bfloat16")
    exported, _ = load_model_and_tokenizer(str(tmp_path / "model"), device="cpu", dtype="bfloat16")
    buffers = {name: buffer.dtype for name, buffer in exported.named_buffers()}
    assert any(dtype == torch.float32 for dtype in buffers.values())  # (the model has such a buffer)
    assert {name: buffer.dtype for name, buffer in from_run.named_buffers()} == buffers
    assert {p.dtype for p in from_run.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(logits(from_run), logits(exported), atol=0, rtol=0)
