"""The training loop on CPU: a tiny model learns, resume is exact, LoRA/KL/RFT paths run."""

from __future__ import annotations

import math
import json
import warnings

import pytest
import torch
from support import SayAEnv, train_config

from rftgym.core.errors import ConfigError
from rftgym.train import TrainConfig
from rftgym.train.loop import train
from rftgym.train.run_dir import checkpoint_path, is_run_dir


config = train_config


def test_tiny_model_learns_the_task(tmp_path, make_char_policy):
    policy = make_char_policy()
    history = train(config(tmp_path), policy=policy, make_env=SayAEnv)
    assert not policy.model.training  # handed back as it came (the update ran in train mode)
    first = sum(h["reward_mean"] for h in history[:4]) / 4
    last = sum(h["reward_mean"] for h in history[-4:]) / 4
    assert first < 0.25, first  # a random policy over 32 tokens rarely says 'a'
    assert last > 0.6, [round(h["reward_mean"], 2) for h in history]
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 25))  # step N is the Nth step
    assert (out / "learning_curve.png").stat().st_size > 1000
    assert (out / "checkpoint" / "state.json").is_file()


def test_resume_reproduces_the_uninterrupted_run(tmp_path, make_char_policy):
    straight = train(config(tmp_path, "straight", steps=5, save_every=3), policy=make_char_policy(), make_env=SayAEnv)
    # Interrupted after 3 steps, then resumed by a fresh process-like start (new policy object).
    train(config(tmp_path, "resumed", steps=3), policy=make_char_policy(), make_env=SayAEnv)
    resumed = train(config(tmp_path, "resumed", steps=5), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert [h["step"] for h in resumed] == [4, 5]  # after the checkpoint at step 3
    for a, b in zip(straight[3:], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["reward_mean"] == a["reward_mean"]
    # metrics.jsonl has each step once, as the uninterrupted run's has them.
    resumed_rows, straight_rows = ([json.loads(r) for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                                   for run in ("resumed", "straight"))
    assert [r["step"] for r in resumed_rows] == [r["step"] for r in straight_rows] == [1, 2, 3, 4, 5]
    for a, b in zip(straight_rows, resumed_rows, strict=True):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)


def test_the_rollouts_do_not_depend_on_the_rollout_batch_size(tmp_path, make_char_policy):
    # Keyed sampling: each episode draws by (step, task, member), whatever shares its batch.
    wide = train(config(tmp_path, "wide", steps=2, rollout_batch_size=16), policy=make_char_policy(), make_env=SayAEnv)
    narrow = train(config(tmp_path, "narrow", steps=2, rollout_batch_size=3), policy=make_char_policy(),
                   make_env=SayAEnv)
    for a, b in zip(wide, narrow, strict=True):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    assert wide[0]["reward_mean"] != wide[1]["reward_mean"] or wide[0]["loss"] != wide[1]["loss"]


def test_evaluation_during_training_leaves_the_training_as_it_was(tmp_path, make_char_policy, monkeypatch):
    import rftgym.train.loop as loop
    from rftgym.agents.hf_policy import SamplingConfig
    from rftgym.rollout import RolloutConfig, run_episodes
    from rftgym.train.base_model import base_fingerprint

    seen = []  # the weights each evaluation played

    def recording(make_env, policy, *args, **kwargs):
        seen.append(base_fingerprint(policy.model))
        return evaluate_policy(make_env, policy, *args, **kwargs)

    evaluate_policy = loop.evaluate_policy

    plain = train(config(tmp_path, "plain", steps=4), policy=make_char_policy(), make_env=SayAEnv)
    policy = make_char_policy()
    # The untrained policy's greedy episodes, which the evaluation before training plays.
    untrained = make_char_policy()
    untrained.sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    baseline = run_episodes(SayAEnv, untrained, list(range(7, 12)), config=RolloutConfig(num_envs=32))
    monkeypatch.setattr(loop, "evaluate_policy", recording)
    evaluated = train(config(tmp_path, "evaluated", steps=4, eval_every=3, eval_episodes=5, eval_seed=7,
                             eval_before_training=True), policy=policy, make_env=SayAEnv)
    # before training (the untrained weights), after step 3 and after step 4
    assert len(seen) == 3 and seen[0] == base_fingerprint(untrained.model) and len(set(seen)) == 3
    for a, b in zip(plain, evaluated):  # the same rollouts and updates, step by step
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-8)
    # After step 3 (every 3rd step) and after the last step only.
    assert [("eval_reward_mean" in h) for h in evaluated] == [False, False, True, True]
    assert [h["step"] for h in evaluated if "eval_reward_mean" in h] == [3, 4]
    # The last evaluation is the trained policy's greedy episodes on seeds 7..11.
    policy.sampling = SamplingConfig(max_new_tokens=8, temperature=0.0)
    episodes = run_episodes(SayAEnv, policy, list(range(7, 12)), config=RolloutConfig(num_envs=32))
    assert evaluated[-1]["eval_reward_mean"] == pytest.approx(sum(e.total_reward for e in episodes) / 5)
    assert evaluated[-1]["eval_success_rate"] == pytest.approx(sum(e.success for e in episodes) / 5)
    rows = [json.loads(line) for line in (tmp_path / "evaluated" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_reward_mean" in r] == [0, 3, 4]
    # Step 0 is the evaluation before training: in the log, not among the steps train() returns.
    assert rows[0]["eval_reward_mean"] == pytest.approx(sum(e.total_reward for e in baseline) / 5)
    assert "reward_mean" not in rows[0] and evaluated[0]["step"] == 1


def test_evaluation_settings_are_checked():
    for settings, message in [({"eval_every": -1}, "eval_every must be an int >= 0"),
                              ({"eval_episodes": 0}, "eval_episodes must be a positive integer"),
                              ({"eval_seed": -3}, r"eval_seed must be an int in \[0, 2\*\*63\)"),
                              ({"eval_seed": 2**63 - 2, "eval_episodes": 5}, "lower eval_seed"),
                              ({"eval_before_training": True}, "eval_before_training=True is only read with "
                                                               r"eval_every > 0"),
                              ({"eval_before_training": 1, "eval_every": 2}, "eval_before_training must be True or "
                                                                             "False, got 1")]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**settings)


def test_a_process_groups_timeout_in_a_run_of_one_process_is_said_to_change_nothing(tmp_path, make_char_policy):
    with pytest.warns(UserWarning, match=r"dist_timeout_s=10 \(--dist-timeout\) changes nothing in a run of one "
                                         "process"):
        train(config(tmp_path, steps=1, dist_timeout_s=10), policy=make_char_policy(), make_env=SayAEnv)


def test_existing_checkpoint_is_not_overwritten_without_resume(tmp_path, make_char_policy):
    train(config(tmp_path, steps=1), policy=make_char_policy(), make_env=SayAEnv)
    with pytest.raises(ConfigError, match="--resume"):
        train(config(tmp_path, steps=2), policy=make_char_policy(), make_env=SayAEnv)


def test_lora_with_kl_trains_adapters_only(tmp_path, make_char_policy):
    policy = make_char_policy()
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    history = train(config(tmp_path, steps=2, lora_rank=4, kl_coef=0.1, learning_rate=1e-2), policy=policy,
                    make_env=SayAEnv)
    assert all("kl_ref" in h for h in history if h["updates"])
    base = policy.model.get_base_model()
    changed_lora = False
    for name, param in base.named_parameters():
        if "lora_" in name:
            changed_lora |= param.requires_grad
        else:
            key = name.replace(".base_layer", "")
            assert torch.equal(param, before[key]), f"base weight {name} changed"
    assert changed_lora


def test_a_lora_resume_needs_the_base_model_it_was_trained_on(tmp_path, make_char_policy):
    # The checkpoint holds the adapters only: on another base model they would fit its shapes and
    # mean nothing, and the KL reference (adapters off) would be another model.
    train(config(tmp_path, "lora", steps=1, lora_rank=4, kl_coef=0.1), policy=make_char_policy(), make_env=SayAEnv)
    with pytest.raises(ConfigError, match="these base weights .* are not that policy's"):
        train(config(tmp_path, "lora", steps=2, lora_rank=4, kl_coef=0.1), policy=make_char_policy(seed=1),
              make_env=SayAEnv, resume=True)
    history = train(config(tmp_path, "lora", steps=2, lora_rank=4, kl_coef=0.1), policy=make_char_policy(),
                    make_env=SayAEnv, resume=True)
    assert [h["step"] for h in history] == [2]


def test_the_base_fingerprint_ignores_the_load_dtype_and_not_the_weights(make_char_policy):
    import torch

    from rftgym.train.base_model import base_fingerprint

    model = make_char_policy().model
    print_ = base_fingerprint(model)
    assert base_fingerprint(make_char_policy().model.to(torch.bfloat16)) == print_
    assert base_fingerprint(make_char_policy(seed=1).model) != print_
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0  # one sampled weight changed
    assert base_fingerprint(model) != print_


def test_a_lora_rank_above_every_layers_full_rank_is_refused_before_any_adapter(make_char_policy):
    from rftgym.train.model_setup import prepare_model

    policy = make_char_policy()  # width 32, MLP 64: no adapted layer has a rank above 32
    with pytest.raises(ConfigError, match=r"lora_rank 33 is above the full rank of every layer LoRA would adapt "
                                          r"\(at most 32 in this model\)"):
        prepare_model(policy, TrainConfig(lora_rank=33))
    assert not hasattr(policy.model, "peft_config")  # refused before anything was built
    model = prepare_model(policy, TrainConfig(lora_rank=32))
    assert any("lora_" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("algo", ["dr_grpo", "rloo", "rft", "dcpo", "pcar"])
def test_every_algorithm_runs_a_step(tmp_path, make_char_policy, algo):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = train(config(tmp_path, steps=2, algo=algo, aggregation="sequence_mean"), policy=make_char_policy(),
                        make_env=SayAEnv)
    assert len(history) == 2
    # SayAEnv scores no search and its contexts are never edited: PCAR and DCPO say they trained as GRPO, once.
    said = [str(w.message).split(":")[0] for w in caught if "trained as GRPO" in str(w.message)]
    assert said == ([f"algo {algo}"] if algo in ("pcar", "dcpo") else [])
    assert all(h["loss"] is None or h["loss"] == h["loss"] for h in history)  # no NaN


def test_pcar_and_dcpo_are_quiet_when_their_signal_is_there():
    from rftgym.core.records import Episode, Turn
    from rftgym.train.signals import unused_signal

    def episode(info, prompts, env_id="e"):
        turns = [Turn(index=i, context_ids=(), action="a", reward=0.0, terminated=i == len(prompts) - 1,
                      truncated=False, info=dict(info), prompt_ids=p, sampled_ids=[5], logprobs=[0.0])
                 for i, p in enumerate(prompts)]
        return Episode(env_id=env_id, seed=0, messages={}, turns=turns, final_context_ids=())

    plain = episode({"evaluation_score": None}, [[1], [1, 5, 2]])  # one segment; a score key with no score
    scored = episode({"evaluation_score": 7}, [[1], [1, 5, 2]])
    edited = episode({}, [[1], [3]])  # the context was edited: two segments
    assert "PCAR trained as GRPO" in unused_signal("pcar", [plain, edited])
    assert unused_signal("pcar", [plain, scored]) is None
    assert "DCPO trained as GRPO" in unused_signal("dcpo", [plain, scored])
    assert unused_signal("dcpo", [plain, edited]) is None
    assert unused_signal("grpo", [plain]) is None
    # RFT trains on successes: an env that never says whether an episode succeeded gives none.
    assert "no turn's info had 'success'" in unused_signal("rft", [plain, edited])
    assert unused_signal("rft", [plain, episode({"success": False}, [[1]])]) is None
    # In the env made for it, what was missing is the policy's part.
    in_memory_env = episode({}, [[1], [1, 5, 2]], env_id="rftgym/MemoryQA-v0")
    assert unused_signal("dcpo", [in_memory_env]).endswith("the policy made no <prune> edit")
    searched = episode({"evaluation_score": None, "query": "q"}, [[1]], env_id="rftgym/SearchEvalQA-v0")
    assert "the policy evaluated none of its searches" in unused_signal("pcar", [searched])
    never_searched = episode({"evaluation_score": None, "query": None}, [[1]], env_id="rftgym/SearchEvalQA-v0")
    assert "the policy made no search at all (<search>query</search>)" in unused_signal("pcar", [never_searched])


def test_turn_counts_count_the_replies_played_their_format_errors_and_cut_replies():
    from rftgym.core.records import CONTEXT_FULL, Episode, Turn
    from rftgym.rollout.metrics import turn_counts

    def turn(i, finish, info=None):
        return Turn(index=i, context_ids=(), action="a", reward=0.0, terminated=False, truncated=False,
                    info=info or {}, prompt_ids=[1], sampled_ids=[5], logprobs=[0.0], finish_reason=finish)

    first = Episode(env_id="e", seed=0, messages={}, final_context_ids=(),
                    turns=[turn(0, "stop", {"format_error": "no <answer> tag"}), turn(1, "length")])
    # the empty turn that ends an episode for want of context is no reply
    second = Episode(env_id="e", seed=1, messages={}, final_context_ids=(),
                     turns=[turn(0, "length", {"format_error": None}), turn(1, CONTEXT_FULL)])
    assert turn_counts([first, second]) == [3, 1, 2]
    assert turn_counts([]) == [0, 0, 0]


def test_pcar_and_dcpo_are_refused_up_front_only_where_the_env_declares_it_lacks_their_signal(monkeypatch):
    import gymnasium as gym

    from rftgym.train.signals import refuse_idle_algorithm

    for algo, env_id in (("pcar", "rftgym/SearchEvalQA-v0"), ("dcpo", "rftgym/MemoryQA-v0"),
                         ("grpo", "rftgym/VerifiableQA-v0"), ("rloo", "rftgym/CodeTCG-v0")):
        refuse_idle_algorithm(algo, env_id)  # each in the env made for it, and the others anywhere
    for algo, env_id in (("pcar", "rftgym/MemoryQA-v0"), ("dcpo", "rftgym/SearchEvalQA-v0"),
                         ("pcar", "rftgym/CodeTCG-v0")):
        with pytest.raises(ConfigError, match=f"{env_id} gives no .* so {algo} would train as plain GRPO") as refused:
            refuse_idle_algorithm(algo, env_id)
        assert refused.value.fields == ("algo",)
    # An env that declares nothing is trained, and said of after a step if it gave nothing (above).
    monkeypatch.setitem(gym.registry, "mine/Plain-v0", gym.envs.registration.EnvSpec("mine/Plain-v0", SayAEnv))
    refuse_idle_algorithm("pcar", "mine/Plain-v0")


def test_an_on_step_that_raises_stops_the_run_with_that_step_saved(tmp_path, make_char_policy):
    class EarlyStop(Exception):
        pass

    def stop_at_2(row):
        if row["step"] == 2:
            raise EarlyStop

    with pytest.raises(EarlyStop):  # save_every=100: without the stop's save no checkpoint would exist
        train(config(tmp_path, steps=4), policy=make_char_policy(), make_env=SayAEnv, on_step=stop_at_2)
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2
    # The env came from make_env=: a resume without it would make gymnasium.make(env_id)'s, another env.
    with pytest.raises(ConfigError, match=r"made its env with train\(..., make_env=...\).* resume it with the same "
                                          "make_env="):
        train(config(tmp_path, steps=4), policy=make_char_policy(), resume=True)
    rows = train(config(tmp_path, steps=4), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert [row["step"] for row in rows] == [3, 4]


def test_train_refuses_what_it_cannot_use_before_any_work(tmp_path, make_char_policy):
    from rftgym.agents.scripted import ScriptedAgent

    with pytest.raises(TypeError, match=r"train takes a TrainConfig, got dict \(a dict of settings: "
                                        r"TrainConfig.from_dict\(settings\)\)"):
        train(config(tmp_path).to_dict())
    with pytest.raises(TypeError, match="policy must be an HFPolicy .* got ScriptedAgent"):
        train(config(tmp_path), policy=ScriptedAgent(["a"]), make_env=SayAEnv)
    with pytest.raises(TypeError, match=r"make_env is a function that makes a new env each call, e.g. lambda: "
                                        r"gym.make\(env_id\) .* got an env"):
        train(config(tmp_path), policy=make_char_policy(), make_env=SayAEnv())
    with pytest.raises(TypeError, match=r"on_step is a function called with each step's metrics row .* got str"):
        train(config(tmp_path), policy=make_char_policy(), make_env=SayAEnv, on_step="print")
    with pytest.raises(ConfigError, match=r"env_kwargs \['word'\] are read only when train makes the env"):
        train(config(tmp_path, env_kwargs={"word": "a"}), policy=make_char_policy(), make_env=SayAEnv)
    with pytest.raises(ConfigError, match="device='tpu': not a torch device"):
        train(config(tmp_path, device="tpu"), policy=make_char_policy(), make_env=SayAEnv)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device='cuda': this torch build or machine has no CUDA; use cpu"):
            train(config(tmp_path, device="cuda"), policy=make_char_policy(), make_env=SayAEnv)
    # A model already wrapped in peft adapters: its run could be neither exported nor resumed.
    from peft import LoraConfig, get_peft_model

    adapted = make_char_policy()
    adapted.model = get_peft_model(adapted.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match=r"policy.model carries peft adapters; .* Pass the base model \(a "
                                          r"PeftModel's get_base_model\(\), or merge_and_unload\(\)"):
        train(config(tmp_path, lora_rank=4), policy=adapted, make_env=SayAEnv)
    assert not (tmp_path / "run").exists()


def test_the_evaluation_plays_its_own_env_options_over_the_runs(tmp_path, monkeypatch, make_char_policy):
    import gymnasium

    from support import ECHO_MODULE

    (tmp_path / "echo_eval_module.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoEval-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    made, real_make = [], gymnasium.make
    monkeypatch.setattr(gymnasium, "make", lambda *args, **kwargs: made.append(kwargs) or real_make(*args, **kwargs))
    history = train(config(tmp_path, steps=1, env_id="echo_eval_module:mine/EchoEval-v0", env_kwargs={"word": "hi"},
                           eval_every=1, eval_episodes=3, eval_env_kwargs={"word": "held-out"}),
                    policy=make_char_policy())
    assert {kwargs["word"] for kwargs in made} == {"hi", "held-out"}
    # one env checked as the run starts, then one per evaluation episode
    assert [kwargs["word"] for kwargs in made].count("held-out") == 1 + 3
    assert "eval_said" in history[0]  # (the env's own column, from the evaluation's episodes)
    # An option the evaluation's env refuses stops the run before its first step, not at its first evaluation.
    with pytest.raises(TypeError, match="wrod"):
        train(config(tmp_path, "bad", steps=1, env_id="echo_eval_module:mine/EchoEval-v0", eval_every=1,
                     eval_env_kwargs={"wrod": "x"}), policy=make_char_policy())
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match=r"eval_env_kwargs \['word'\] are read only when train makes the env"):
        train(config(tmp_path, "caller", steps=1, eval_every=1, eval_env_kwargs={"word": "x"}),
              policy=make_char_policy(), make_env=SayAEnv)


def test_env_options_that_are_no_json_are_said_to_be_kept_as_text(tmp_path, monkeypatch, make_char_policy):
    from support import ECHO_MODULE

    # An env with an option the user gives an object (a set here: not a JSON value).
    module = ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoNote-v0").replace('def __init__(self, word="hi"):',
                                                                           'def __init__(self, word="hi", note=None):')
    (tmp_path / "echo_note_module.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"env options \['note'\] are not JSON values .* the checkpoint keeps only "
                                         r"their text, so a resume must give them again"):
        train(config(tmp_path, steps=1, env_id="echo_note_module:mine/EchoNote-v0", env_kwargs={"note": {"a"}}),
              policy=make_char_policy())
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["config"]["env_kwargs"] == {"note": "{'a'}"}
    assert TrainConfig(env_kwargs={"dataset_path": tmp_path / "x.jsonl"}).env_kwargs == \
        {"dataset_path": str(tmp_path / "x.jsonl")}  # a pathlib path is a path (and JSON, as text)


def test_gradient_checkpointing_gives_the_same_first_loss(tmp_path, make_char_policy):
    plain = train(config(tmp_path, "a", steps=1), policy=make_char_policy(), make_env=SayAEnv)
    checkpointed = train(config(tmp_path, "b", steps=1, gradient_checkpointing=True), policy=make_char_policy(),
                         make_env=SayAEnv)
    assert checkpointed[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("env_id, algo", [("rftgym/SearchEvalQA-v0", "pcar"), ("rftgym/MemoryQA-v0", "dcpo")])
def test_pcar_and_dcpo_train_on_their_envs(tmp_path, make_char_policy, env_id, algo, monkeypatch):
    import gymnasium

    from rftgym.envs.common import env_metadata

    made = []
    real_make = gymnasium.make
    monkeypatch.setattr(gymnasium, "make", lambda *args, **kwargs: made.append(kwargs) or real_make(*args, **kwargs))
    # Zero-variance filtering off, so that the update runs even when every tiny-model reply fails.
    cfg = config(tmp_path, steps=1, env_id=env_id, algo=algo, group_size=2, tasks_per_step=1, max_new_tokens=6,
                 filter_zero_variance=False, eval_every=1, eval_episodes=2)
    # One token per character: these envs' prompts need a context of thousands of positions.
    policy = make_char_policy(max_position_embeddings=16384)
    history = train(cfg, policy=policy)
    assert history[0]["context_full_rate"] == 0
    # The evaluation has the env's own columns, as `rftgym eval` prints them (None where none reported).
    columns = {f"eval_{column}" for column, _, _ in env_metadata(env_id)["eval_metrics"]}
    assert columns and columns <= history[0].keys()
    assert all(history[0][c] is None or math.isfinite(history[0][c]) for c in columns)
    # a random model's replies run to max_new_tokens; each rate is a share of the replies played
    assert history[0]["turns_mean"] >= 1 and history[0]["cut_reply_rate"] > 0.5
    assert 0 < history[0]["format_error_rate"] <= 1
    assert history[0]["updates"] >= 1 and history[0]["trained_tokens"] > 0
    assert history[0]["loss"] == history[0]["loss"]  # not NaN
    # MemoryQA's context budget counts with the policy's tokenizer in training, as in `rftgym eval`
    # (with the env's estimate there, a policy that kept the budget in training broke it in eval).
    assert made and all(("count_tokens" in kwargs) == (env_id == "rftgym/MemoryQA-v0") for kwargs in made)
    if env_id == "rftgym/MemoryQA-v0":
        context = real_make(env_id).reset(seed=0)[0]
        assert made[0]["count_tokens"](context) == len(policy.chat.prompt_ids(context))


def test_env_metadata_is_read_without_making_an_env(tmp_path, monkeypatch):
    from rftgym.envs.common import env_metadata, with_policy_token_counter

    from support import ECHO_MODULE

    assert env_metadata("rftgym/MemoryQA-v0")["token_counter_option"] == "count_tokens"
    assert "token_counter_option" not in env_metadata("rftgym/VerifiableQA-v0")
    (tmp_path / "echo_meta_mod.py").write_text(ECHO_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(env_metadata("echo_meta_mod:mine/Echo-v0"), dict)  # imports the module first

    class Chat:
        def prompt_ids(self, context):
            return [0] * 7

    policy = type("Policy", (), {"chat": Chat()})()
    memory = env_metadata("rftgym/MemoryQA-v0")
    assert with_policy_token_counter(memory, {}, policy)["count_tokens"](None) == 7
    assert with_policy_token_counter(memory, {"count_tokens": len}, policy) == {"count_tokens": len}  # the caller's
    assert with_policy_token_counter(memory, {"x": 1}, object()) == {"x": 1}  # no tokenizer: the env's estimate
    assert with_policy_token_counter({}, {"x": 1}, policy) == {"x": 1}  # no budget option


def test_evaluation_split_maps_the_envs_offset_to_sampled_tokens(make_char_policy):
    from rftgym.core.records import Turn
    from rftgym.train.batching import evaluation_split

    policy = make_char_policy()
    text = "evaluate score six. search next"  # the character tokenizer's alphabet: letters, space, dot
    ids = policy.chat.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert policy.chat.decode_reply(ids) == text
    end = text.index(".") + 1
    turn = Turn(index=1, context_ids=(), action=text, reward=0.0, terminated=False, truncated=False,
                info={"evaluation_score": 6, "evaluation_end": end}, prompt_ids=[1], sampled_ids=ids,
                logprobs=[0.0] * len(ids))
    split = evaluation_split(policy)(turn)
    assert policy.chat.decode_reply(ids[:split]) == text[:end]  # one character per token here
    assert evaluation_split(policy)(Turn(index=0, context_ids=(), action="", reward=0.0, terminated=False,
                                         truncated=False, info={}, sampled_ids=ids)) is None
    import numpy as np

    from rftgym.core.errors import EnvContractError

    turn.info["evaluation_end"] = np.int64(end)  # numpy ints are offsets too
    assert evaluation_split(policy)(turn) == split
    # A turn that only evaluates is the evaluation's span whole, its sampled stop token included
    # (mapped, its end offset falls before that token, which then went to the next span).
    evaluation_only = "evaluate score six. "
    ids = policy.chat.tokenizer(evaluation_only, add_special_tokens=False)["input_ids"]
    for end in (len(evaluation_only) - 1, len(evaluation_only)):
        only = Turn(index=1, context_ids=(), action=evaluation_only, reward=0.0, terminated=False, truncated=False,
                    info={"evaluation_score": 6, "evaluation_end": end}, prompt_ids=[1],
                    sampled_ids=ids + [policy.tokenizer.eos_token_id], logprobs=[0.0] * (len(ids) + 1))
        assert evaluation_split(policy)(only) is None
    for bad in (-3, len(text) + 1, 2.0, True):
        turn.info["evaluation_end"] = bad
        with pytest.raises(EnvContractError, match=rf"info\['evaluation_end'\] is {bad!r}; it is a character offset"):
            evaluation_split(policy)(turn)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_recomputed_old_logprobs_are_the_updates_own(tmp_path, make_char_policy, pack, monkeypatch):
    from dataclasses import replace

    from rftgym.train import update

    from rftgym.train.batching import TrainSample, collate
    from rftgym.train.update import batch_logprobs, optimise, recompute_old_logprobs

    policy = make_char_policy()
    model = policy.model
    ids = [[5, 9, 11, 4, 7, 8], [6, 8, 3], [7, 7, 9], [4, 5, 6, 7]]
    samples = [TrainSample(t, [0, 0] + [1] * (len(t) - 2), [-5.0] * len(t), [0.0, 0.0] + [1.0] * (len(t) - 2), 0, i)
               for i, t in enumerate(ids)]
    config = TrainConfig(minibatch_size=4, group_size=2, kl_coef=0.0, old_logprobs="recompute",
                         pack_sequences=pack)
    rows = []
    real_collate_packed = update.collate_packed
    monkeypatch.setattr(update, "collate_packed", lambda *a: rows.append(real_collate_packed(*a)["input_ids"].shape[0])
                        or real_collate_packed(*a))
    fresh, gap = recompute_old_logprobs(model, samples, config, policy.pad_id)
    # Packed into rows of 6 tokens, the two 3-token samples share one.
    assert rows == ([3] if pack else [])
    with torch.no_grad():
        want, _ = batch_logprobs(model, collate(samples, policy.pad_id), config)
    for row, (old, new) in enumerate(zip(samples, fresh)):
        n = len(old.token_ids)
        assert new.old_logprobs[:2] == [-5.0, -5.0]  # untrained positions keep what they had
        assert new.old_logprobs[2:] == pytest.approx(want[row, 1:n - 1].tolist(), abs=1e-5)
        assert replace(new, old_logprobs=old.old_logprobs) == old  # nothing else changed
    trained = [abs(-5.0 - v) for row, s in enumerate(samples) for v in want[row, 1:len(s.token_ids) - 1].tolist()]
    assert gap["old_logprob_gap"] == pytest.approx(sum(trained) / len(trained), rel=1e-5)
    assert gap["old_logprob_gap_max"] == pytest.approx(max(trained), rel=1e-5)
    # The first update then starts from ratio 1 exactly, whatever the rollout recorded.
    stats = optimise(model, None, torch.optim.SGD(model.parameters(), lr=1e-3), fresh, config, policy.pad_id,
                     torch.Generator().manual_seed(0))
    monkeypatch.undo()
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and stats["approx_kl"] == pytest.approx(0.0, abs=1e-9)


def test_rollout_is_cap_weights_each_trained_tokens_advantage(make_char_policy):
    """Truncated importance sampling: each trained token's advantage is multiplied by
    min(exp(recomputed - rollout), cap). The rollout's log-probs are set 1 below the training
    pass's (weight e = 2.718, capped at 2) on even positions and 1 above (weight 1/e) on odd ones."""
    from rftgym.train.batching import TrainSample, collate
    from rftgym.train.update import batch_logprobs, recompute_old_logprobs

    policy = make_char_policy()
    ids = [[5, 9, 11, 4, 7, 8], [6, 8, 3, 2]]
    config = TrainConfig(minibatch_size=2, group_size=2, old_logprobs="recompute", rollout_is_cap=2.0)
    probe = [TrainSample(t, [0, 0] + [1] * (len(t) - 2), [0.0] * len(t), [0.0] * len(t), 0, i) for i, t in enumerate(ids)]
    with torch.no_grad():
        want, _ = batch_logprobs(policy.model, collate(probe, policy.pad_id), config)
    samples = []
    for row, t in enumerate(ids):
        rollout = [-5.0, -5.0] + [want[row, p - 1].item() + (-1.0 if p % 2 == 0 else 1.0) for p in range(2, len(t))]
        samples.append(TrainSample(t, [0, 0] + [1] * (len(t) - 2), rollout, [0.0, 0.0] + [-3.0] * (len(t) - 2), 0, row))
    fresh, stats = recompute_old_logprobs(policy.model, samples, config, policy.pad_id)
    weights = []
    for sample in fresh:
        expected = [2.0 if p % 2 == 0 else math.exp(-1.0) for p in range(2, len(sample.token_ids))]
        assert sample.advantages[:2] == [0.0, 0.0]  # untrained positions: untouched
        assert sample.advantages[2:] == pytest.approx([-3.0 * w for w in expected], rel=1e-5)
        weights += expected
    assert stats["rollout_is_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    assert stats["rollout_is_capped"] == pytest.approx(sum(w == 2.0 for w in weights) / len(weights))
    # Without a cap the advantages are the rollout's, and no weight is reported.
    plain, stats = recompute_old_logprobs(policy.model, samples, replace_config(config, rollout_is_cap=0.0),
                                          policy.pad_id)
    assert [s.advantages for s in plain] == [s.advantages for s in samples] and "rollout_is_weight_mean" not in stats


def replace_config(config, **changes):
    from dataclasses import replace

    return replace(config, **changes)


def test_training_with_dual_clip_logs_its_fraction(tmp_path, make_char_policy):
    """Dual clip goes from the config to the loss: a ratio cap of 1.0001 on the second epoch's
    ratios holds some negative-advantage tokens, which the metrics count apart from the low clip."""
    history = train(config(tmp_path / "dual", steps=2, clip_ratio_c=1.0001, epochs_per_step=2),
                    policy=make_char_policy(), make_env=SayAEnv)
    assert all(math.isfinite(h["loss"]) for h in history)
    assert any(h["clip_fraction_dual"] > 0 for h in history), history
    assert all(h["clip_fraction"] >= h["clip_fraction_dual"] + h["clip_fraction_low"] - 1e-9 for h in history)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_training_with_sequence_level_ratios(tmp_path, make_char_policy, pack):
    """GSPO's ratio trains end to end; with several epochs over a step's batch the policy moves
    between them, and a sequence ratio other than 1 shows that the ratio was taken."""
    def run(level):
        return train(config(tmp_path / level, steps=2, ratio_level=level, clip_low=3e-4, clip_high=4e-4,
                            epochs_per_step=2, pack_sequences=pack), policy=make_char_policy(), make_env=SayAEnv)

    history, per_token = run("sequence"), run("token")
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert any(h["clip_fraction"] > 0 for h in history)  # a 4e-4 clip on the second epoch's ratios
    # The same seeds, the same first rollout: only the ratio differs, and with it the clipping.
    assert [h["clip_fraction"] for h in history] != [h["clip_fraction"] for h in per_token]
    with pytest.raises(ConfigError, match="ratio_level must be one of token, sequence"):
        TrainConfig(ratio_level="segment")
    with pytest.raises(ConfigError, match="ratio_level='sequence'"):
        TrainConfig(algo="rft", group_size=1, ratio_level="sequence")


def test_dynamic_sampling_refills_the_groups_the_filter_drops_and_resumes_exactly(tmp_path, make_char_policy):
    # Groups of 2 random 8-token replies often both lack an 'a' (reward 0 alike): the refill rolls
    # out 2 more tasks until 2 groups vary, at most 4 times a step.
    refill = dict(steps=5, group_size=2, tasks_per_step=2, max_rollout_batches=4)
    straight = train(config(tmp_path, "straight", save_every=3, **refill), policy=make_char_policy(), make_env=SayAEnv)
    assert any(row["rollout_batches"] > 1 for row in straight), straight
    for row in straight:
        assert row["groups_kept"] == 2 or row["rollout_batches"] == 4, row   # filled, or out of rollouts
        assert row["samples"] == 2 * row["groups_kept"]   # only the first 2 varied groups train
        # A refill follows a rollout with a uniform group, which the rate counts (over every group rolled out).
        assert row["uniform_group_rate"] > 0 or row["rollout_batches"] == 1
    plain = train(config(tmp_path, "plain", steps=1, group_size=2, tasks_per_step=2), policy=make_char_policy(),
                  make_env=SayAEnv)
    assert "rollout_batches" not in plain[0]
    # A resume from the checkpoint at step 3 draws the tasks and samples the uninterrupted run did.
    train(config(tmp_path, "resumed", **{**refill, "steps": 3}), policy=make_char_policy(), make_env=SayAEnv)
    resumed = train(config(tmp_path, "resumed", **refill), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    for a, b in zip(straight[3:], resumed, strict=True):
        assert (b["rollout_batches"], b["reward_mean"]) == (a["rollout_batches"], a["reward_mean"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)


def test_the_refill_is_read_only_where_groups_are_filtered():
    with pytest.raises(ConfigError, match="max_rollout_batches=3 is only read with filter_zero_variance=True and a "
                                          r"policy-gradient algo .* this run has filter_zero_variance=False"):
        TrainConfig(max_rollout_batches=3, filter_zero_variance=False)
    with pytest.raises(ConfigError, match="max_rollout_batches=3 is only read with .* this run has algo='rft'"):
        TrainConfig(algo="rft", group_size=1, max_rollout_batches=3)
    with pytest.raises(ConfigError, match="max_rollout_batches must be a positive integer, got 0"):
        TrainConfig(max_rollout_batches=0)


def test_rollout_is_cap_is_read_only_with_recomputed_old_logprobs():
    with pytest.raises(ConfigError, match="rollout_is_cap=2.0 is only read with old_logprobs='recompute'"):
        TrainConfig(rollout_is_cap=2.0)
    with pytest.raises(ConfigError, match="rollout_is_cap must be 0 \\(off\\) or at least 1"):
        TrainConfig(rollout_is_cap=0.5, old_logprobs="recompute")
    with pytest.raises(ConfigError, match="rollout_is_cap must be a finite number"):
        TrainConfig(rollout_is_cap=float("inf"), old_logprobs="recompute")
    # rft has no ratio to correct: told so, not sent to old_logprobs='recompute', which it refuses too.
    with pytest.raises(ConfigError, match="algo='rft' .* no use for rollout_is_cap=2.0"):
        TrainConfig(algo="rft", group_size=1, rollout_is_cap=2.0)


def test_training_with_recomputed_old_logprobs(tmp_path, make_char_policy):
    # On the CPU in float32 the rollout's log-probs already match the training pass closely.
    history = train(config(tmp_path, steps=2, old_logprobs="recompute", rollout_is_cap=2.0), policy=make_char_policy(),
                    make_env=SayAEnv)
    assert all(h["old_logprob_gap"] < 1e-4 for h in history)
    # With the sampler and the update this close, every importance weight is 1.
    assert all(h["rollout_is_weight_mean"] == pytest.approx(1.0, abs=1e-3) and h["rollout_is_capped"] == 0
               for h in history)
    assert all(h["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for h in history)
    with pytest.raises(ConfigError, match="old_logprobs"):
        TrainConfig(old_logprobs="current")


def test_resume_refuses_what_it_cannot_continue(tmp_path, make_char_policy):
    run = config(tmp_path, "run", steps=1)
    train(run, policy=make_char_policy(), make_env=SayAEnv)
    checkpoint = tmp_path / "run" / "checkpoint"
    # Already at the last step: say how to continue, before any model loads (there is none here).
    from dataclasses import replace

    with pytest.raises(ConfigError, match="already at step 1 and this run has 1 step;"):
        train(replace(run, model=str(tmp_path / "no-such-model")), make_env=SayAEnv, resume=True)
    # Other base weights (the same shapes, another seed) are not the policy it was trained from.
    with pytest.raises(ConfigError, match="trained from a policy passed in from memory .* are not that policy's"):
        train(config(tmp_path, "run", steps=2), policy=make_char_policy(seed=1), make_env=SayAEnv, resume=True)
    # A damaged file is named (by its checksum, for the files that have one), and the checkpoint is
    # left as it was.
    for name, damage in (("state.json", b"{not json"), ("trainable.pt", b""), ("optimizer.pt", b"garbage")):
        original = (checkpoint / name).read_bytes()
        (checkpoint / name).write_bytes(damage)
        with pytest.raises(ConfigError, match=f"cannot resume from the checkpoint|{name} is not the file its save"):
            train(config(tmp_path, "run", steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
        assert (checkpoint / name).read_bytes() == damage
        (checkpoint / name).write_bytes(original)
    with pytest.raises(ConfigError, match="nothing to resume"):
        train(config(tmp_path, "other", steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    # Restored, it resumes.
    history = train(config(tmp_path, "run", steps=2), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert [h["step"] for h in history] == [2]


def test_train_makes_an_env_of_your_own_from_module_colon_id(tmp_path, make_char_policy, monkeypatch):
    from support import ECHO_MODULE

    (tmp_path / "echo_train_module.py").write_text(ECHO_MODULE.replace("mine/Echo-v0", "mine/EchoTrain-v0"))
    monkeypatch.syspath_prepend(str(tmp_path))
    history = train(config(tmp_path, steps=1, env_id="echo_train_module:mine/EchoTrain-v0", env_kwargs={"word": "a"},
                           filter_zero_variance=False), policy=make_char_policy())
    assert history[0]["samples"] > 0


def test_the_compile_scope_reaches_the_update_and_a_skipped_one_is_named(tmp_path, monkeypatch, make_char_policy,
                                                                        capsys):
    import rftgym.train.loop as loop

    seen = []
    apply = loop.apply_training_speedups

    def spy(model, speed=None):
        seen.append(speed)
        return apply(model, speed)

    monkeypatch.setattr(loop, "apply_training_speedups", spy)
    train(train_config(tmp_path, steps=1, compile_scope="decoder"), policy=make_char_policy(),
          make_env=SayAEnv)
    assert seen[0].compile_scope == "decoder" and seen[0].compile_layers is False
    assert "'compile_decoder': 'skipped: compile is off" in capsys.readouterr().out


def test_the_segment_generator_draws_apart_from_the_sampler():
    from rftgym.train.loop import segment_seed

    # The sampler of rank r is seeded with seed + r; seeded alike, two CPU generators agree.
    for seed, rank in [(0, 0), (7, 1), (2**40, 3)]:
        sampler = torch.Generator().manual_seed(seed + rank)
        segments = torch.Generator().manual_seed(segment_seed(seed, rank))
        assert not torch.equal(torch.rand(8, generator=sampler), torch.rand(8, generator=segments))
    assert segment_seed(5, 0) == segment_seed(5, 0) and segment_seed(5, 0) != segment_seed(5, 1)
    assert 0 <= segment_seed(2**62, 9) < 2**63


def test_adding_lora_adapters_warns_of_nothing_the_user_can_act_on(tmp_path, make_char_policy):
    from rftgym.train.model_setup import with_lora

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = with_lora(make_char_policy().model, config(tmp_path, lora_rank=4))
    assert any("lora_" in name for name, _ in model.named_parameters())


def test_on_step_sees_each_steps_metrics_as_it_ends(tmp_path, make_char_policy):
    seen = []

    def on_step(metrics):
        seen.append(metrics)
        assert (tmp_path / "run" / "metrics.jsonl").is_file()  # called after the step was logged

    history = train(train_config(tmp_path, "run", steps=2, tasks_per_step=1, group_size=2, minibatch_size=2),
                    policy=make_char_policy(), make_env=SayAEnv, on_step=on_step)
    assert [m["step"] for m in seen] == [1, 2] and seen == history


def test_a_run_keeps_its_earlier_checkpoints_and_goes_on_from_a_copy_of_one(tmp_path, make_char_policy):
    straight = train(config(tmp_path, "straight", steps=5, save_every=1, keep_checkpoints=3), policy=make_char_policy(),
                     make_env=SayAEnv)
    out = tmp_path / "straight"
    # The last checkpoint and the two before it; older ones removed as each save made room.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint", "checkpoint-3", "checkpoint-4"]
    assert [json.loads((out / name / "state.json").read_text())["step"]
            for name in ("checkpoint", "checkpoint-3", "checkpoint-4")] == [5, 3, 4]
    # An earlier checkpoint is not an output directory to train in ...
    with pytest.raises(ConfigError, match=r"is an earlier checkpoint the run in .*straight keeps, not a run's output "
                                          r"directory.*To go on from step 3 instead, copy the folder to NEW/checkpoint"):
        train(config(out, "checkpoint-3", steps=5), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    # ... and a copy of it goes on exactly as the run did from that step.
    import shutil

    shutil.copytree(out / "checkpoint-3", tmp_path / "again" / "checkpoint")
    again = train(config(tmp_path, "again", steps=5), policy=make_char_policy(), make_env=SayAEnv, resume=True)
    assert [h["step"] for h in again] == [4, 5]
    for a, b in zip(straight[3:], again, strict=True):
        assert b["reward_mean"] == a["reward_mean"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)


def test_a_hand_copy_of_a_kept_checkpoint_is_never_removed_though_it_carries_the_marker(tmp_path, make_char_policy):
    import shutil

    train(config(tmp_path, "run", steps=2, save_every=1, keep_checkpoints=2), policy=make_char_policy(),
          make_env=SayAEnv)
    out = tmp_path / "run"
    shutil.copytree(out / "checkpoint-1", out / "checkpoint-0")   # cp -r: the .kept marker comes along
    train(config(tmp_path, "run", steps=4, save_every=1, keep_checkpoints=2), policy=make_char_policy(),
          make_env=SayAEnv, resume=True)
    # The run's own kept folders beyond the one it keeps went; the copy stayed.
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint", "checkpoint-0", "checkpoint-3"]


def test_a_runs_last_checkpoint_folder_reads_as_the_run_and_is_no_output_directory(tmp_path, make_char_policy):
    train(config(tmp_path, "run", steps=2), policy=make_char_policy(), make_env=SayAEnv)
    last = tmp_path / "run" / "checkpoint"
    # A run there was accepted, and the parent's next save replaced it without a word.
    for resume in (False, True):
        with pytest.raises(ConfigError, match=r"is the last checkpoint of the run in .*run, not a run's output "
                                              r"directory .*--output-dir .*run --resume"):
            train(config(tmp_path / "run", "checkpoint", steps=3), policy=make_char_policy(), make_env=SayAEnv,
                  resume=resume)
    assert is_run_dir(last) and checkpoint_path(last) == last


def test_the_callers_env_reports_its_own_evaluation_columns(tmp_path, make_char_policy):
    class Declaring(SayAEnv):
        metadata = {"render_modes": [], "eval_metrics": (("won", "success", "final_rate"),)}

    rows = train(config(tmp_path, "declared", steps=2, eval_every=2, eval_episodes=4), policy=make_char_policy(),
                 make_env=Declaring)
    assert rows[-1]["eval_won"] == rows[-1]["eval_success_rate"]

    # A malformed declaration, or one taking the evaluation's own names: warned about, none reported.
    for name, spec, problem in (("Malformed", ("won",), r"the entry 'won' is not a \(column, info key, reducer\)"),
                                ("Taking", (("reward_mean", "success", "final_rate"),),
                                 r"it names the column\(s\) reward_mean twice or as one of the evaluation's own")):
        made = type(name, (SayAEnv,), {"metadata": {"render_modes": [], "eval_metrics": spec}})
        with pytest.warns(UserWarning, match=rf"the env make_env makes \({name}\): metadata\['eval_metrics'\] is "
                                             rf"malformed \({problem}.*so the evaluation during training reports "
                                             r"none of its columns$"):
            rows = train(config(tmp_path, name, steps=1, eval_every=1, eval_episodes=2), policy=make_char_policy(),
                         make_env=made)
        assert {key for key in rows[-1] if key.startswith("eval_")} == {
            "eval_reward_mean", "eval_success_rate", "eval_sampled_tokens_mean", "eval_seconds"}


def test_each_row_reports_reply_lengths_advantages_uniform_groups_and_timings(tmp_path, make_char_policy):
    rows = train(config(tmp_path, "run", steps=3), policy=make_char_policy(), make_env=SayAEnv)
    episodes = 2 * 8   # config: 2 tasks x groups of 8
    for row in rows:
        assert row["sampled_tokens_min"] <= row["sampled_tokens_mean"] <= row["sampled_tokens_max"]
        assert row["uniform_group_rate"] in (0.0, 0.5, 1.0)   # of 2 groups
        if row["trained_tokens"]:
            assert row["advantage_min"] <= row["advantage_mean"] <= row["advantage_max"]
        else:
            assert row["advantage_mean"] is row["advantage_min"] is row["advantage_max"] is None
        assert row["rollout_seconds"] + row["update_seconds"] <= row["step_seconds"]
        assert row["rollout_tokens_per_second"] == pytest.approx(
            row["sampled_tokens_mean"] * episodes / row["rollout_seconds"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"uniform_group_rate", "advantage_mean", "update_seconds", "sampled_tokens_max"} <= set(logged[-1])


def test_logged_steps_keep_their_first_episodes_for_reading(tmp_path, make_char_policy):
    from rftgym.core.records import read_episodes_jsonl

    rows = train(config(tmp_path, "run", steps=4, log_every=2, log_episodes=3), policy=make_char_policy(),
                 make_env=SayAEnv)
    folder = tmp_path / "run" / "episodes"
    assert sorted(p.name for p in folder.iterdir()) == ["step-2.jsonl", "step-4.jsonl"]   # the logged steps only
    episodes = list(read_episodes_jsonl(folder / "step-4.jsonl"))
    assert len(episodes) == 3
    # What the policy wrote and what the env paid for it (SayAEnv: the share of 8 tokens that are 'a').
    assert [e.total_reward for e in episodes] == [e.turns[0].action.count("a") / 8 for e in episodes]
    assert all(e.turns[0].sampled_ids for e in episodes) and rows[-1]["step"] == 4


def test_a_runs_stop_strings_end_its_rollouts_replies(tmp_path, make_char_policy):
    """TrainConfig.stop reaches the rollouts: every reply ends at its first 'b' or 'g' (or the end
    of the turn, or the token limit), and those that hold one say 'stop'. (Letters that no special
    token's text holds: one is a single token here.)"""
    from rftgym.core.records import read_episodes_jsonl

    train(config(tmp_path, "run", steps=1, log_episodes=16, stop=("b", "g")), policy=make_char_policy(),
          make_env=SayAEnv)
    turns = [e.turns[0] for e in read_episodes_jsonl(tmp_path / "run" / "episodes" / "step-1.jsonl")]
    assert len(turns) == 16
    stopped = [t for t in turns if "b" in t.action or "g" in t.action]
    assert stopped and all(t.action[-1] in "bg" and t.action.count("b") + t.action.count("g") == 1 for t in stopped)
    assert all(t.finish_reason == "stop" for t in stopped)
