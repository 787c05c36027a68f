"""What PCAR and DCPO read from an env's episodes besides the reward, and the checks that an env
gives it: before a run (from what the env declares) and after its first step (from what the
episodes held). Kept free of torch, so that the command line can refuse a run before it loads one.

An env declares its signals in ``metadata["train_signals"]``: ``"evaluation_score"`` (turns
whose ``info`` scores the agent's evaluation of a search) and ``"context_edits"`` (episodes
split into segments where the agent edited its context)."""

from __future__ import annotations

from ..core.errors import ConfigError
from ..envs.common import env_metadata

PROCESS_SCORE_KEY = "evaluation_score"
PROCESS_SPLIT_KEY = "evaluation_end"  # character offset in the action just after the evaluation
PROCESS_SEARCH_KEY = "query"  # the query a turn ran (None on turns that did not search)
CONTEXT_EDITS = "context_edits"

# algo -> (signal, what the algorithm does with it, the signal in words, a built-in env that gives it)
ALGORITHM_SIGNALS = {
    "pcar": (PROCESS_SCORE_KEY, "scales each search's advantage by the env's score of the agent's evaluation of it",
             f"evaluation scores (info[{PROCESS_SCORE_KEY!r}])", "rftgym/SearchEvalQA-v0"),
    "dcpo": (CONTEXT_EDITS, "trains the segments between the agent's edits of its context", "context edits",
             "rftgym/MemoryQA-v0"),
}


def refuse_idle_algorithm(algo: str, env_id: str) -> None:
    """Refuse PCAR or DCPO on an env that declares (``metadata["train_signals"]``) that its
    episodes never give what the algorithm works on: it would train as plain GRPO, a step later
    (:func:`unused_signal` says so of an env that declares nothing)."""
    need = ALGORITHM_SIGNALS.get(algo)
    if need is None:
        return
    signals = env_metadata(env_id).get("train_signals")
    if signals is None or need[0] in signals:
        return
    _, does, what, example = need
    raise ConfigError(f"{algo} {does}; {env_id} gives no {what}, so {algo} would train as plain GRPO there. Train "
                      f"with grpo, or on an env that gives them ({example})", field="algo")


def unused_signal(algo: str, episodes) -> str | None:
    """Why PCAR or DCPO trained as plain GRPO on ``episodes``, or why RFT can never train, or None:
    PCAR scales advantages by the env's per-search evaluation scores, DCPO trains the segments
    between context edits, RFT the episodes whose last ``info["success"]`` is true; without them
    there is nothing for them to do (most likely an env that has no such signal)."""
    env_ids = {e.env_id for e in episodes}
    if algo == "rft" and not any("success" in t.info for e in episodes for t in e.turns):
        return ("algo rft: no turn's info had 'success', so no episode can count as successful and rft trains on "
                "nothing; the env must set info['success'] (True when the task is solved) on an episode's last turn")
    if algo == "pcar" and not any(t.info.get(PROCESS_SCORE_KEY) is not None for e in episodes for t in e.turns):
        example = ALGORITHM_SIGNALS["pcar"][3]
        if env_ids != {example}:
            why = f"PCAR needs an env that scores each search ({example}) and a policy that evaluates its searches"
        elif any(t.info.get(PROCESS_SEARCH_KEY) is not None for e in episodes for t in e.turns):
            why = "the policy evaluated none of its searches (<evaluate>score: N</evaluate> right after a search)"
        else:
            why = ("the policy made no search at all (<search>query</search>), so there was nothing to evaluate; it "
                   "needs to follow the env's tag protocol first (a model tuned to it, or a system prompt that shows it)")
        return f"algo pcar: no turn had info[{PROCESS_SCORE_KEY!r}], so PCAR trained as GRPO; {why}"
    if algo == "dcpo" and all(len(e.segments) <= 1 for e in episodes):
        example = ALGORITHM_SIGNALS["dcpo"][3]
        why = ("the policy made no <prune> edit" if env_ids == {example} else f"DCPO needs an env whose context "
               f"the agent edits ({example}) and a policy that edits it")
        return f"algo dcpo: no episode edited its context (one segment each), so DCPO trained as GRPO; {why}"
    return None
