"""CodeTCG's step_scorer as a string ("rollout", "rollout:N"): what a command line and a saved
TrainConfig can hold. rftgym eval and rftgym train bind it to their policy
(envs.common.with_policy_options); an env made directly refuses it, saying so."""

from __future__ import annotations

import copy
import json
import sys
import warnings

import gymnasium as gym
import pytest

import rftgym  # noqa: F401  (registers the envs)
from rftgym.agents.scripted import ScriptedAgent
from rftgym.core.errors import ConfigError
from rftgym.core.records import read_episodes_jsonl
from rftgym.envs.code.env import CodeTCGConfig, CodeTCGEnv
from rftgym.envs.code.process import PolicyRollouts, RolloutStepScorer
from rftgym.envs.code.sandbox_shared import open_shares
from rftgym.envs.common import env_metadata, with_policy_options, with_policy_stand_in

ENV_ID = "rftgym/CodeTCG-v0"
PLAN = "<pseudocode>\n1. read the input\n2. compute the answer\n3. return it\n</pseudocode>"


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture
def tcg(tmp_path):
    return {"cache_dir": str(tmp_path / "tcg"), "n_random": 4}  # as a JSON config gives a TCGConfig


def test_a_spec_in_an_env_made_directly_says_who_binds_it_and_what_to_pass_instead(tcg):
    with pytest.raises(ConfigError) as caught:
        gym.make(ENV_ID, dataset="generated", pseudocode=True, step_scorer="rollout", process_weight=0.5, tcg=tcg)
    message = str(caught.value)
    assert message.startswith("step_scorer='rollout' stands for a RolloutStepScorer over the policy that acts in "
                              "the env, and no policy was bound to it: rftgym eval and rftgym train bind their agent "
                              "to it"), message
    assert "rftgym.envs.common.with_policy_options(CodeTCGEnv.metadata, env_kwargs, agent)" in message
    assert message.endswith("an env made directly takes the scorer itself: step_scorer=RolloutStepScorer(agent)")
    assert caught.value.fields == ("step_scorer",)


@pytest.mark.parametrize("spec", ["rollout:0", "rollout:x", "other", "rollout:", "rollout:-1", "rollout:2.5",
                                  " rollout", "Rollout"])
def test_a_spec_that_names_no_scorer_is_refused_naming_the_forms_that_work(spec, tcg):
    policy = ScriptedAgent("x")
    for make in (lambda: gym.make(ENV_ID, dataset="generated", pseudocode=True, step_scorer=spec, tcg=tcg),
                 lambda: with_policy_options(CodeTCGEnv.metadata, {"step_scorer": spec}, policy)):
        with pytest.raises(ConfigError) as caught:
            make()
        message = str(caught.value)
        assert message.startswith(f"step_scorer={spec!r} names no step scorer; a string there is 'rollout' ("), message
        assert "or 'rollout:N' (N completions per prefix, averaged; N a positive int)" in message
        assert message.endswith("from Python, give a callable (task, steps) -> scores, e.g. RolloutStepScorer(agent)")
        assert caught.value.fields == ("step_scorer",)


def test_a_step_scorer_that_is_neither_callable_nor_a_spec_names_the_command_line_form(tcg):
    with pytest.raises(ConfigError, match=r"step_scorer must be a callable \(task, steps\) -> scores, e\.g\. "
                                          r"RolloutStepScorer\(agent\) \(on the command line: --env-arg "
                                          r"step_scorer=rollout\), got int 3"):
        gym.make(ENV_ID, dataset="generated", pseudocode=True, step_scorer=3, tcg=tcg)


def test_process_weight_without_a_scorer_points_to_the_command_line_spec():
    with pytest.raises(ConfigError) as caught:
        gym.make(ENV_ID, dataset="generated", process_weight=0.5)
    assert str(caught.value).endswith("add a step_scorer, with pseudocode=True (on the command line: --env-arg "
                                      "step_scorer=rollout --env-arg pseudocode=true; from Python: "
                                      "step_scorer=RolloutStepScorer(agent)), or drop process_weight")


def test_with_policy_options_binds_the_spec_to_the_policy_and_only_where_the_env_declares_it():
    policy = ScriptedAgent("x")
    code = env_metadata(ENV_ID)
    assert code["policy_options"] == {"step_scorer": PolicyRollouts}
    bound = with_policy_options(code, {"step_scorer": "rollout:3", "process_weight": 0.5}, policy)
    scorer = bound["step_scorer"]
    assert isinstance(scorer, PolicyRollouts) and scorer.agent is policy and scorer.samples == 3
    assert bound["process_weight"] == 0.5
    assert with_policy_options(code, {"step_scorer": "rollout"}, policy)["step_scorer"].samples == 1
    own = RolloutStepScorer(policy)
    assert with_policy_options(code, {"step_scorer": own}, policy) == {"step_scorer": own}  # the caller's own
    assert with_policy_options(code, {"pseudocode": True}, policy) == {"pseudocode": True}  # none asked for
    # An env that declares no such option is left as it is (its own error names the unknown option).
    assert with_policy_options(env_metadata("rftgym/VerifiableQA-v0"), {"step_scorer": "rollout"}, policy) == \
        {"step_scorer": "rollout"}
    with pytest.raises(ConfigError, match="step_scorer='rollout' scores with the policy that acts in the env, and "
                                          "object is no agent"):
        with_policy_options(code, {"step_scorer": "rollout"}, object())


def test_with_policy_options_also_binds_the_token_counter():
    class Chat:
        def prompt_ids(self, context):
            return [0] * 7

    class Policy(ScriptedAgent):
        chat = Chat()

    policy = Policy("x")
    bound = with_policy_options(env_metadata("rftgym/MemoryQA-v0"), {}, policy)
    assert bound["count_tokens"](None) == 7


def test_a_bound_spec_scores_with_the_policy_in_the_envs_own_sandbox(tmp_path, tcg):
    probe = gym.make(ENV_ID, dataset="generated", tcg=tcg)
    probe.reset(seed=4)
    reference = probe.unwrapped.task.reference
    probe.close()
    asked = []

    def policy_reply(context):  # the reference once two steps of the plan are seen, junk before
        asked.append(context[-1].content)
        return fenced(reference) if "2. " in context[-1].content else fenced("x = 1")

    kwargs = with_policy_options(CodeTCGEnv.metadata, {"dataset": "generated", "pseudocode": True, "tcg": tcg,
                                                       "step_scorer": "rollout:2", "process_weight": 0.5},
                                 ScriptedAgent(policy_reply))
    before = open_shares("local")
    env = gym.make(ENV_ID, **kwargs)
    # gymnasium's env checker copies the spec on env.spec: the binding comes along, not a copy of the policy
    assert env.spec.kwargs["step_scorer"] is kwargs["step_scorer"]
    scorer = env.unwrapped._step_scorer
    assert isinstance(scorer, RolloutStepScorer) and scorer.samples == 2
    assert scorer.sandbox is env.unwrapped.sandbox  # its limits and isolation; no share of its own
    env.reset(seed=4)
    _, reward, terminated, _, info = env.step(PLAN)
    assert not terminated and info["step_scores"] == [0.0, 1.0, 1.0]
    assert reward == pytest.approx(0.5 * 2 / 3)
    assert len(asked) == 3 * 2 and all("A plan for the solution" in prompt for prompt in asked)
    # A copy scores in its own share; closing every env gives back all that the scorers held.
    branch = copy.deepcopy(env.unwrapped)
    assert branch._step_scorer is not scorer and branch._step_scorer.sandbox is branch.sandbox
    assert open_shares("local") == before + 2
    branch.close()
    env.close()
    assert env.unwrapped._step_scorer is None
    assert open_shares("local") == before


class Uncopyable(ScriptedAgent):
    """An agent that must not be copied (as a policy holding a model)."""

    def __deepcopy__(self, memo):
        raise AssertionError("the scorer's agent was copied")


def test_a_scorer_of_the_callers_without_a_sandbox_grades_in_the_envs_share(tcg):
    own = RolloutStepScorer(Uncopyable(fenced("x = 1")), samples=2)
    before = open_shares("local")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium's spec copy would warn, and leave env.spec None
        env = gym.make(ENV_ID, dataset="generated", pseudocode=True, tcg=tcg, step_scorer=own)
    assert env.spec is not None and env.spec.kwargs["step_scorer"].agent is own.agent  # shared, not copied
    scorer = env.unwrapped._step_scorer
    assert scorer is not own and scorer.agent is own.agent and scorer.samples == 2
    assert scorer.sandbox is env.unwrapped.sandbox  # the env's limits and isolation, not a default local share
    env.reset(seed=1)
    assert env.step(PLAN)[-1]["step_scores"] == [0.0, 0.0, 0.0]
    env.close()
    assert own._sandbox is None and open_shares("local") == before  # it never opened one of its own


def test_a_scorer_given_its_own_sandbox_is_used_as_given(tcg):
    from rftgym.envs.code.sandbox_shared import shared_sandbox

    sandbox = shared_sandbox("local")
    own = RolloutStepScorer(ScriptedAgent(fenced("x = 1")), sandbox=sandbox)
    env = gym.make(ENV_ID, dataset="generated", pseudocode=True, tcg=tcg, step_scorer=own)
    assert env.unwrapped._step_scorer is own and copy.deepcopy(own).sandbox is sandbox
    env.close()
    sandbox.close()


class RecordingSandbox:
    """A sandbox that runs programs in ``inner`` and records each batch it was given."""

    def __init__(self, inner):
        self.inner, self.batches = inner, []
        self.limits = inner.limits

    def run_many(self, programs):
        self.batches.append(list(programs))
        return self.inner.run_many(programs)

    def run(self, program):
        return self.run_many([program])[0]


def test_a_plans_completions_are_graded_in_one_batch_giving_up_on_loops_as_the_env_does(tcg):
    from rftgym.envs.code.sandbox import make_sandbox

    probe = gym.make(ENV_ID, dataset="generated", tcg=tcg)
    probe.reset(seed=4)
    task = probe.unwrapped.task
    probe.close()
    loop = f"def {task.entry_point}(*args, **kwargs):\n    while True:\n        pass"

    def completer(context):  # prose for one step, the reference for two, a loop for three
        plan = context[-1].content
        return "no code" if "2. " not in plan else fenced(loop if "3. " in plan else task.reference)

    with make_sandbox("local") as inner:
        sandbox = RecordingSandbox(inner)
        scorer = RolloutStepScorer(ScriptedAgent(completer), samples=2, sandbox=sandbox, max_timeouts=1)
        assert scorer(task, ["read the input", "compute the answer", "return it"]) == [0.0, 1.0, 0.0]
    assert [len(batch) for batch in sandbox.batches] == [4]  # steps 2 and 3, two completions each: one batch
    assert {json.loads(p.files["tests.json"])["max_timeouts"] for p in sandbox.batches[0]} == {1}


@pytest.mark.parametrize("max_timeouts", [None, 1, 5])
def test_a_scorer_grading_in_the_envs_share_gives_up_on_loops_as_the_env_does(tcg, max_timeouts):
    own = RolloutStepScorer(ScriptedAgent(fenced("x = 1")))
    assert own.max_timeouts == CodeTCGConfig().max_timeouts == 3  # one default
    env = gym.make(ENV_ID, dataset="generated", pseudocode=True, tcg=tcg, step_scorer=own, max_timeouts=max_timeouts)
    assert env.unwrapped._step_scorer.max_timeouts == max_timeouts
    assert copy.deepcopy(env.unwrapped._step_scorer).max_timeouts == max_timeouts
    env.close()


@pytest.mark.parametrize("option, value", [("max_timeouts", 0), ("max_timeouts", True), ("max_timeouts", 1.5),
                                           ("samples", True), ("max_steps", 0)])
def test_a_scorer_refuses_a_count_that_is_not_a_positive_int(option, value):
    with pytest.raises(ConfigError, match=f"{option} must be a positive int") as caught:
        RolloutStepScorer(ScriptedAgent("x"), **{option: value})
    assert caught.value.fields == (option,)


def test_envs_made_from_one_bound_spec_leak_no_sandbox_share(tcg):
    kwargs = with_policy_options(CodeTCGEnv.metadata, {"dataset": "generated", "pseudocode": True, "tcg": tcg,
                                                       "step_scorer": "rollout"}, ScriptedAgent(fenced("x = 1")))
    before = open_shares("local")
    envs = [gym.make(ENV_ID, **kwargs) for _ in range(3)]
    for env in envs:
        env.reset(seed=1)
        assert env.step(PLAN)[-1]["step_scores"] == [0.0, 0.0, 0.0]
    assert open_shares("local") == before + 3  # one share per env: its own, which its scorer grades in
    for env in envs:
        env.close()
    assert open_shares("local") == before


def test_the_stand_in_binding_checks_what_the_spec_requires_and_never_acts(tcg):
    """rftgym eval's and train's first make, before the policy loads."""
    options = {"dataset": "generated", "step_scorer": "rollout", "process_weight": 0.5, "tcg": tcg}
    with pytest.raises(ConfigError, match=r"step_scorer scores pseudocode steps; set pseudocode=True \(on the "
                                          r"command line: --env-arg pseudocode=true\) or drop step_scorer"):
        gym.make(ENV_ID, **with_policy_stand_in(CodeTCGEnv.metadata, options))
    env = gym.make(ENV_ID, **with_policy_stand_in(CodeTCGEnv.metadata, {**options, "pseudocode": True}))
    env.reset(seed=1)
    with pytest.raises(RuntimeError, match="made to check its options before the policy was loaded"):
        env.step(PLAN)
    env.close()


# ---------------------------------------------------------------- from the command line

# An agent of the user's own (--agent plan_agent_mod:make): plans, then writes the task's solution
# (MBPP's add_i), also when the step scorer asks it to complete a plan.
PLAN_AGENT_MODULE = '''
from rftgym.agents.scripted import ScriptedAgent

PLAN = "<pseudocode>\\n1. take x\\n2. add the number\\n</pseudocode>"
ASKED = []


def reply(context):
    prompt = context[-1].content
    if "A plan for the solution" in prompt:
        ASKED.append(prompt)
    elif "Now write" not in prompt:  # the task itself: the plan first
        return PLAN
    number = "\\n".join(m.content for m in context).split("adds ")[1].split(".")[0]
    return f"```python\\ndef add_{number}(x):\\n    return x + {number}\\n```"


def make():
    agent = ScriptedAgent(reply)
    agent.name = "planner"
    return agent
'''


@pytest.fixture
def mini_mbpp(tmp_path, monkeypatch):
    monkeypatch.setenv("RFTGYM_CACHE", str(tmp_path / "cache"))
    records = [{"task_id": i, "text": f"Write a function that adds {i}.", "code": f"def add_{i}(x):\n    return x + {i}",
                "test_list": [f"assert add_{i}(1) == {1 + i}", f"assert add_{i}(5) == {5 + i}"],
                "test_setup_code": "", "challenge_test_list": []} for i in range(2)]
    data = tmp_path / "mini_mbpp.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    (tmp_path / "plan_agent_mod.py").write_text(PLAN_AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "plan_agent_mod", raising=False)  # its ASKED afresh
    return data


def test_eval_binds_step_scorer_rollout_to_its_agent(tmp_path, mini_mbpp, capsys):
    from rftgym.cli import main

    out = tmp_path / "code.jsonl"
    assert main(["eval", ENV_ID, "--agent", "plan_agent_mod:make", "--env-arg", "dataset=mbpp",
                 "--env-arg", f"dataset_path={mini_mbpp}", "--env-arg", "pseudocode=true",
                 "--env-arg", "step_scorer=rollout:2", "--env-arg", "process_weight=0.5", "--out", str(out)]) == 0
    import plan_agent_mod

    assert len(plan_agent_mod.ASKED) == 2 * 2 * 2  # 2 episodes x 2 prefixes x 2 samples, by the eval's agent
    for episode in read_episodes_jsonl(out):
        plan, code = episode.turns
        assert plan.info["step_scores"] == [1.0, 1.0] and plan.reward == pytest.approx(0.5)
        assert code.info["success"]


@pytest.mark.parametrize("args, message", [
    (["--env-arg", "step_scorer=rollout:0"], "step_scorer='rollout:0' names no step scorer; a string there is "
                                             "'rollout' ("),
    (["--env-arg", "step_scorer=rollout"], "step_scorer scores pseudocode steps; set pseudocode=True (on the "
                                           "command line: --env-arg pseudocode=true) or drop step_scorer"),
    (["--env-arg", "process_weight=0.5"], "(on the command line: --env-arg step_scorer=rollout --env-arg "
                                          "pseudocode=true; from Python: step_scorer=RolloutStepScorer(agent))"),
])
@pytest.mark.parametrize("command", ["eval", "train"])
def test_the_command_line_refuses_a_step_scorer_it_cannot_bind_before_any_model_loads(tmp_path, mini_mbpp, capsys,
                                                                                       monkeypatch, command, args,
                                                                                       message):
    from rftgym.cli import evaluate, main
    from rftgym.train import loop

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded for a refused option")

    monkeypatch.setattr(evaluate, "_build_agent", no_model)
    monkeypatch.setattr(loop, "train", no_model)
    given = ["--agent", "plan_agent_mod:make", "--episodes", "1"] if command == "eval" else \
        ["--steps", "1", "--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exited:
        main([command, ENV_ID, *given, "--env-arg", "dataset=mbpp", "--env-arg", f"dataset_path={mini_mbpp}", *args])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_train_keeps_the_spec_in_its_config_and_binds_it_to_the_policy(tmp_path, mini_mbpp, monkeypatch):
    """The training path up to train(): the spec passes the CLI's check, is saved as the string it
    is, and with_policy_options (which train calls where it makes its envs) binds it."""
    from rftgym.cli import main
    from rftgym.train import TrainConfig, loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda config, resume=False, on_step=None: seen.append(config) or [])
    assert main(["train", ENV_ID, "--steps", "1", "--output-dir", str(tmp_path / "run"), "--env-arg", "dataset=mbpp",
                 "--env-arg", f"dataset_path={mini_mbpp}", "--env-arg", "pseudocode=true",
                 "--env-arg", "step_scorer=rollout:3", "--env-arg", "process_weight=0.25"]) == 0
    config = seen[0]
    assert config.env_kwargs["step_scorer"] == "rollout:3"
    saved = TrainConfig.from_saved(json.loads(json.dumps(config.to_dict())))  # as a checkpoint keeps it
    assert saved.env_kwargs == config.env_kwargs
    policy = ScriptedAgent("x")
    kwargs = with_policy_options(env_metadata(saved.env_id), saved.env_kwargs, policy)
    env = gym.make(saved.env_id, **kwargs)
    assert env.unwrapped._step_scorer.agent is policy and env.unwrapped._step_scorer.samples == 3
    env.close()
