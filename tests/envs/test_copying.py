"""copy.deepcopy and pickle of every env mid-episode: the copy goes on as the original would, the
two are independent afterwards, and shared resources live until the last env holding them closes."""

from __future__ import annotations

import copy
import pickle

import gymnasium as gym
import pytest

import rftgym  # noqa: F401
from rftgym.envs.code.sandbox_shared import open_shares

CODE = "```python\ndef solve(*args):\n    return 0\n```"
# (env id, options, first action, the next two actions: the same for both, then one each)
EPISODES = {
    "verifiable": ("rftgym/VerifiableQA-v0", {"max_attempts": 3}, "<answer>1</answer>",
                   ("<answer>2</answer>", "<answer>3</answer>", "<answer>4</answer>")),
    "search": ("rftgym/SearchEvalQA-v0", {}, "<search>capital city</search>",
               ("<evaluate>score: 4 vague</evaluate><search>river</search>",
                "<evaluate>score: 7 good</evaluate><answer>Paris</answer>",
                "<evaluate>score: 1 bad</evaluate><search>mountain</search>")),
    "memory": ("rftgym/MemoryQA-v0", {}, "<search>birthplace</search>",
               ('<prune ids="r1">nothing useful</prune><search>currency</search>',
                '<answer id="1">euro</answer>', "<search>language</search>")),
    "code": ("rftgym/CodeTCG-v0", {"max_attempts": 3}, CODE,
             (CODE.replace("return 0", "return 1"), CODE.replace("return 0", "return None"),
              CODE.replace("return 0", "return args"))),
}


def _transcript(context) -> list[tuple[str, str, str]]:
    return [(m.id, m.role, m.content) for m in context]


def _step(env, action):
    context, reward, terminated, truncated, info = env.step(action)
    return _transcript(context), reward, terminated, truncated, info


def _copies(env):
    yield "deepcopy", copy.deepcopy(env)
    yield "pickle", pickle.loads(pickle.dumps(env))


@pytest.mark.parametrize("name", list(EPISODES))
def test_a_copy_mid_episode_goes_on_as_the_original_and_apart_from_it(name):
    env_id, options, first, (same, mine, theirs) = EPISODES[name]
    made = [gym.make(env_id, **options) for _ in range(2)]
    original, reference = made  # the reference plays the original's part alone, never copied
    try:
        for env in made:
            env.reset(seed=3)
            env.step(first)
        alone = [_step(reference, same), _step(reference, mine)]
        for how, clone in _copies(original):
            try:
                # The copy and its original step alike, then each its own way.
                assert _step(clone, same) == alone[0], how
                assert _step(clone, theirs)[0] != alone[1][0], how
            finally:
                clone.close()
        # Copies stepped after the original's state was taken leave it as it was.
        assert [_step(original, same), _step(original, mine)] == alone
    finally:
        for env in made:
            env.close()


@pytest.mark.parametrize("name", ["search", "memory"])
def test_copies_share_the_retriever_until_the_last_one_closes(name, monkeypatch):
    env_id, options, first, (same, _, _) = EPISODES[name]
    original = gym.make(env_id, **options)
    original.reset(seed=1)
    original.step(first)
    clone = copy.deepcopy(original)
    retriever = original.unwrapped.retriever
    closed = []
    monkeypatch.setattr(retriever, "close", lambda: closed.append(True))
    assert clone.unwrapped.retriever is retriever  # shared, not copied
    original.close()
    original.close()  # twice gives back one share
    assert not closed
    assert _step(clone, same)[0]  # the clone still searches
    clone.close()
    assert closed == [True]  # the last share closed it
    with pytest.raises(RuntimeError, match="copy it before closing it"):
        copy.deepcopy(original)


def test_copies_of_a_code_env_take_their_own_sandbox_share():
    env_id, options, first, _ = EPISODES["code"]
    before = open_shares("local")
    original = gym.make(env_id, **options)
    original.reset(seed=0)
    clone = copy.deepcopy(original)
    assert open_shares("local") == before + 2
    assert clone.unwrapped.sandbox is not original.unwrapped.sandbox
    assert clone.unwrapped.sandbox.limits == original.unwrapped.sandbox.limits
    original.close()
    assert open_shares("local") == before + 1
    assert _step(clone, first)[4]["sandbox"]  # the clone's share still runs programs
    clone.close()
    assert open_shares("local") == before


def test_a_copy_shares_the_callers_retriever_and_pickles_it():
    from rftgym.envs.search.retrievers import make_retriever
    from rftgym.envs.search.world import World

    retriever = make_retriever("bm25", World(0, 30).documents)  # the caller's object, named in the spec too
    env = gym.make("rftgym/SearchEvalQA-v0", retriever=retriever)
    env.reset(seed=0)
    assert env.spec.kwargs["retriever"] is retriever  # gymnasium's wrappers now cache a copy of the spec
    clone = copy.deepcopy(env)
    assert clone.unwrapped.retriever is retriever and clone.unwrapped.spec is env.unwrapped.spec
    assert clone.spec.kwargs["retriever"] is retriever  # retrievers are never copied, even in a spec
    clone.close()  # the caller's retriever is the caller's to close
    moved = pickle.loads(pickle.dumps(env))
    assert _step(moved, "<search>capital</search>") == _step(env, "<search>capital</search>")
    assert [h.doc_id for h in moved.unwrapped.retriever.search(["capital"], 3)[0]] == \
        [h.doc_id for h in retriever.search(["capital"], 3)[0]]


@pytest.mark.parametrize("name", list(EPISODES))
def test_a_copy_has_spaces_of_its_own(name):
    env_id, options, _, _ = EPISODES[name]
    env = gym.make(env_id, **options)
    env.action_space.seed(5)
    branch = copy.deepcopy(env)
    try:
        expected = [copy.deepcopy(env.action_space).sample() for _ in range(1)][0]  # what env draws next
        branch.action_space.sample()  # the branch's draws and seeds are its own
        branch.action_space.seed(99)
        assert env.action_space.sample() == expected
    finally:
        branch.close()
        env.close()


def test_a_verifiable_dataset_is_shared_by_copies(tmp_path):
    import json

    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1), "id": f"q{i}"})
                              for i in range(50)) + "\n")
    env = gym.make("rftgym/VerifiableQA-v0", dataset_path=str(path))
    env.reset(seed=0)
    branch = copy.deepcopy(env)
    assert branch.unwrapped.dataset is env.unwrapped.dataset


@pytest.mark.parametrize("name", ["search", "memory"])
def test_a_dropped_copy_gives_back_its_share_of_the_retriever(name, monkeypatch):
    import gc

    env_id, options, first, _ = EPISODES[name]
    original = gym.make(env_id, **options)
    original.reset(seed=1)
    closed = []
    monkeypatch.setattr(original.unwrapped.retriever, "close", lambda: closed.append(True))
    branch = copy.deepcopy(original)
    _step(branch, first)
    del branch  # a branch of a tree search, dropped without close()
    gc.collect()
    original.close()
    assert closed == [True]


def test_a_copy_of_an_auto_sandbox_env_keeps_its_backend(monkeypatch):
    from rftgym.envs.code import env as code_env

    asked = []
    real = code_env.shared_sandbox

    def recording(backend, **kwargs):
        asked.append(backend)
        return real("local" if backend == "auto" else backend, **kwargs)  # "auto" decided as local here

    monkeypatch.setattr(code_env, "shared_sandbox", recording)
    env = gym.make("rftgym/CodeTCG-v0", sandbox="auto")
    branch = copy.deepcopy(env)
    assert asked == ["auto", "local"]  # the copy does not decide again (a docker probe each time)
    branch.close()
    env.close()
