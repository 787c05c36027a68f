"""From episode groups to training samples: one sample per trained segment.

Every algorithm starts from the episodes of a step, grouped by task (``group_size`` samples of
the same task), and their total rewards:

* GRPO / Dr.GRPO / RLOO: one advantage per episode, given to every sampled token of each of the
  episode's segments.
* PCAR: the GRPO advantage, rescaled per Search->Evaluate span by the standardized evaluation
  score (:func:`~rftgym.train.advantages.pcar_segment_advantages`). A span ends at a turn whose
  ``info`` carries ``evaluation_score``. A search left unevaluated ends its span without a score
  where the next search runs (a turn whose ``info["query"]`` is not None while the last search
  is still unevaluated): such a span, and the turns after the last span, keep the plain advantage
  (factor 1), and their missing score takes no part in the group's standardization, so a skipped
  or unreadable evaluation never borrows the next one's score.
  A turn that evaluates and then searches again (``<evaluate>…</evaluate><search>…</search>``)
  belongs to two spans: when its ``info`` has ``evaluation_end`` (the character offset just after
  the evaluation) and a ``split_tokens`` function is given (the trainer maps the offset to
  sampled tokens with the policy's tokenizer), its tokens up to there close the span and the
  rest, the next query, open the next one. Without them the whole turn closes the span. An
  unreadable evaluation followed by a search is split the same way when its ``info`` has
  ``evaluation_end``; without it the whole turn opens the next span.
* DCPO: the episode's advantage broadcast to each of its segments (split at context edits), with
  at most ``dcpo_segment_budget`` segments per group chosen by
  :func:`~rftgym.train.advantages.sample_segments`. Each segment is trained with its own prompt
  (mask 0), so earlier surviving assistant turns inside a later prompt are never trained twice.
* RFT: the segments of successful episodes, for a supervised step.

Groups whose rewards are all equal carry no signal and are dropped when
``filter_zero_variance`` is on (DAPO's dynamic sampling; with ``max_rollout_batches`` above 1 the
loop rolls out more tasks until ``tasks_per_step`` groups vary, and :func:`first_varied_tasks` picks
those it trains; else the step trains on fewer); with ``filter_overlong``, episodes whose
last reply was cut by the token budget are masked out (DAPO overlong filtering). Only the last
reply counts: an earlier cut reply was answered by the env and the episode went on, so its reward
judges the whole episode; a cut last reply ended the episode unfinished, which is DAPO's case of a
reward that says more about the budget than about the answer. An episode that ended because its
context left no room for another reply (``CONTEXT_FULL``) is cut short in the same way and is
masked too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..core.errors import AgentError, EnvContractError
from ..core.records import CONTEXT_FULL, Episode, Segment
from ..core.values import is_finite_real, is_int
from .advantages import (
    compute_advantages,
    dcpo_segment_advantages,
    overlong_mask,
    pcar_factors,
    sample_segments,
    zero_variance_groups,
)
from .config import BASE_ESTIMATOR, TrainConfig
from .signals import PROCESS_SCORE_KEY, PROCESS_SEARCH_KEY, PROCESS_SPLIT_KEY

CUT_SHORT = ("length", CONTEXT_FULL)  # last-turn finish reasons that overlong filtering masks


@dataclass
class TrainSample:
    token_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]  # per token; 0 where loss_mask is 0
    group: int
    episode: int


@dataclass
class BatchStats:
    groups: int = 0
    groups_kept: int = 0
    groups_uniform: int = 0   # groups whose rewards are all equal (they train nothing under a group baseline)
    episodes_masked_overlong: int = 0
    samples: int = 0
    trained_tokens: int = 0
    # PCAR, over the kept groups: the scored Search->Evaluate spans, and their rescaling factors'
    # sum and sum of squares (the factor is 1 for every span of a group whose scores do not vary).
    pcar_spans: int = 0
    pcar_factor_sum: float = 0.0
    pcar_factor_sq_sum: float = 0.0
    # The advantages of the trained tokens: their sum, least and greatest (0 without any).
    advantage_sum: float = 0.0
    advantage_min: float = 0.0
    advantage_max: float = 0.0


def group_episodes(episodes: list[Episode], group_size: int) -> list[list[Episode]]:
    if len(episodes) % group_size:
        raise ValueError(f"{len(episodes)} episodes do not split into groups of {group_size}")
    return [episodes[i:i + group_size] for i in range(0, len(episodes), group_size)]


def varied_groups(groups: list[list[Episode]]) -> list[bool]:
    """Whether each group's rewards vary (what ``filter_zero_variance`` keeps), in float64 as
    :func:`build_samples` tells them apart."""
    rewards = torch.tensor([[e.total_reward for e in g] for g in groups], dtype=torch.float64)
    return (~zero_variance_groups(rewards)).tolist() if groups else []


def first_varied_tasks(varied: Iterable[int], target: int) -> set[int]:
    """The tasks whose groups a step trains under dynamic sampling's refill (``max_rollout_batches``),
    of the tasks over all ranks whose groups' rewards vary (``varied``, by their index in the order
    the step drew them): the first ``target``, so that every step trains ``target`` groups (or all
    there were, short of it), and the ranks of a launch train those one process would."""
    return set(sorted(varied)[:target])


def turn_spans(episode: Episode, segment: Segment) -> list[tuple[int, int, int]]:
    """(turn index, start, end) of each turn's sampled tokens inside ``segment.token_ids``.

    Inside a segment, a turn's prompt is exactly the segment's tokens so far, so its sampled
    tokens start at ``len(turn.prompt_ids)``.
    """
    spans = []
    for index in segment.turn_indices:
        turn = episode.turns[index]
        start = len(turn.prompt_ids)
        spans.append((index, start, start + len(turn.sampled_ids)))
    return spans


def _sample(segment: Segment, token_advantages: list[float], group: int, episode: int) -> TrainSample:
    return TrainSample(list(segment.token_ids), list(segment.loss_mask), list(segment.logprobs),
                       token_advantages, group, episode)


def _uniform(segment: Segment, value: float) -> list[float]:
    return [value * m for m in segment.loss_mask]


# A piece of a span: (turn index, first sampled token, end token or None for the turn's end).
Piece = tuple[int, int, "int | None"]


def tokens_covering(decode, token_ids: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text has at least ``chars`` characters (binary
    search over prefixes; ``len(token_ids)`` if the whole text is shorter)."""
    low, high = 0, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if len(decode(token_ids[:middle])) >= chars:
            high = middle
        else:
            low = middle + 1
    return low


def _pcar_spans(episode: Episode, split_tokens=None) -> tuple[list[list[Piece]], list[float | None]]:
    """The pieces of each Search->Evaluate span, and each span's score, None for a span whose
    search was never evaluated (see the module docstring for the spans' bounds)."""
    spans, scores, current = [], [], []
    open_search = False  # whether ``current`` holds a search still owed its evaluation
    for turn in episode.turns:
        score = turn.info.get(PROCESS_SCORE_KEY)
        searched = turn.info.get(PROCESS_SEARCH_KEY) is not None
        if score is None and not (searched and open_search):
            current.append((turn.index, 0, None))
            open_search = open_search or searched
            continue
        if score is not None and not is_finite_real(score):
            # One NaN would make the group's score spread NaN and silently switch PCAR off for it.
            raise EnvContractError(f"{_where(episode, turn)}: info[{PROCESS_SCORE_KEY!r}] is {score!r}; a process "
                                   "score is a finite number (or absent on turns that do not evaluate)")
        # This turn evaluates the open search, or searches again with it unevaluated: either way
        # the open span ends here, scored or not.
        split = _evaluation_split(episode, turn, split_tokens)
        if score is None and split is None:  # no evaluation to cut at: the whole turn opens the next span
            spans.append(current)
            current = [(turn.index, 0, None)]
        else:
            current.append((turn.index, 0, split))
            spans.append(current)
            current = [] if split is None else [(turn.index, split, None)]
        scores.append(None if score is None else float(score))
        open_search = searched  # an evaluation opens its turn, so the turn's search comes after it
    spans.append(current)  # after the last evaluation: an unevaluated search, or the answer
    scores.append(None)
    return [s for s in spans if s], [score for span, score in zip(spans, scores) if span]


def _evaluation_split(episode: Episode, turn, split_tokens) -> int | None:
    """How many of ``turn``'s sampled tokens its evaluation takes, when it is followed by more."""
    try:
        split = split_tokens(turn) if split_tokens is not None else None
    except EnvContractError as exc:  # the split function sees the turn only; name the episode too
        raise EnvContractError(f"{_where(episode, turn)}: {exc}") from None
    if split is not None and not 0 < split < len(turn.sampled_ids or ()):
        return None  # nothing after the evaluation (or nothing before it): the whole turn
    return split


def _where(episode: Episode, turn) -> str:
    return f"{episode.env_id} (seed {episode.seed}, turn {turn.index + 1})"  # from 1, as info["turn"]


def _check_old_logprobs(groups: list[list[Episode]], config: TrainConfig) -> None:
    """The PPO ratio's old log-probs come from the rollout unless recomputed: a policy that did not
    record them would otherwise be trained against log-probs of 0 (probability 1). Truncated
    importance sampling weighs the sampler's log-probs even when the ratio's are recomputed."""
    weighed = config.rollout_is_cap > 0
    if config.algo == "rft" or (config.old_logprobs == "recompute" and not weighed):
        return
    for episode in (e for g in groups for e in g):
        for turn in episode.turns:
            if turn.sampled_ids and turn.prompt_ids is not None and turn.logprobs is None:
                if weighed:
                    raise AgentError(f"{_where(episode, turn)}: the policy recorded no log-probs for its sampled "
                                     f"tokens, and --rollout-is-cap {config.rollout_is_cap} weighs each token by "
                                     "the training pass's probability over the sampler's; record them "
                                     "(AgentReply.logprobs) or drop --rollout-is-cap")
                raise AgentError(f"{_where(episode, turn)}: the policy recorded no log-probs for its sampled tokens; "
                                 "record them (AgentReply.logprobs) or train with --old-logprobs recompute")


def build_samples(groups: list[list[Episode]], config: TrainConfig, generator: torch.Generator | None = None,
                  split_tokens=None) -> tuple[list[TrainSample], BatchStats]:
    """One group of episodes per task -> training samples. ``split_tokens(turn) -> int | None``
    (PCAR): how many of a scored turn's sampled tokens belong to its evaluation."""
    stats = BatchStats(groups=len(groups))
    if not groups:
        return [], stats
    _check_old_logprobs(groups, config)
    # float64, as the estimators compute: in float32 distinct rewards can round to one value (above
    # 2^24 apart by 1, or small steps on a large offset) and their group would read as zero-variance.
    rewards = torch.tensor([[e.total_reward for e in g] for g in groups], dtype=torch.float64)
    stats.groups_uniform = int(zero_variance_groups(rewards).sum())

    if config.algo == "rft":
        samples = [
            _sample(segment, _uniform(segment, 1.0), gi, ei)
            for gi, group in enumerate(groups) for ei, episode in enumerate(group) if episode.success
            for segment in episode.segments
        ]
        stats.groups_kept = len({s.group for s in samples})
        return _finish(samples, stats)

    advantages = compute_advantages(BASE_ESTIMATOR[config.algo], rewards)
    keep_group = ~zero_variance_groups(rewards) if config.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
    if config.filter_overlong:
        cut = torch.tensor([[bool(e.turns) and e.turns[-1].finish_reason in CUT_SHORT for e in g] for g in groups])
        keep_episode = overlong_mask(cut).bool()
        stats.episodes_masked_overlong = int((~keep_episode).sum())
    else:
        keep_episode = torch.ones_like(rewards, dtype=torch.bool)

    samples: list[TrainSample] = []
    for gi, group in enumerate(groups):
        if not keep_group[gi]:
            continue
        stats.groups_kept += 1
        group_adv = advantages[gi]
        if config.algo == "dcpo":
            samples += _dcpo_group(group, gi, group_adv, keep_episode[gi], config, generator)
        elif config.algo == "pcar":
            samples += _pcar_group(group, gi, group_adv, keep_episode[gi], config, split_tokens, stats)
        else:
            for ei, episode in enumerate(group):
                if keep_episode[gi, ei]:
                    samples += [_sample(s, _uniform(s, float(group_adv[ei])), gi, ei) for s in episode.segments]
    return _finish(samples, stats)


def _dcpo_group(group, gi, group_adv, keep, config, generator) -> list[TrainSample]:
    # Only segments with sampled tokens compete for the budget: one with none would take a slot
    # and train nothing.
    segments = [[s for s in episode.segments if s.num_sampled] if keep[ei] else [] for ei, episode in enumerate(group)]
    per_segment = dcpo_segment_advantages(group_adv, [len(s) for s in segments])
    budget = config.dcpo_segment_budget or sum(len(s) for s in segments)
    picks = sample_segments([len(s) for s in segments], budget, generator)
    return [_sample(segments[ei][si], _uniform(segments[ei][si], float(per_segment[ei][si])), gi, ei)
            for ei, si in sorted(picks)]


def _pcar_group(group, gi, group_adv, keep, config, split_tokens=None, stats: BatchStats | None = None
                ) -> list[TrainSample]:
    # Every episode's scores enter the group's standardization, overlong-masked ones too: the
    # overlong filter masks an episode's loss, not its place in the group's statistics (its reward
    # stays in the advantage baseline as well, as in DAPO).
    spans_and_scores = [_pcar_spans(e, split_tokens) for e in group]
    factors = pcar_factors([s for _, s in spans_and_scores], config.pcar_lambda, config.pcar_delta)
    # pcar_segment_advantages, with the factors kept for the step's statistics
    rescaled = [group_adv[i] * f for i, f in enumerate(factors)]
    if stats is not None:
        scored = [f for (_, scores), row in zip(spans_and_scores, factors)
                  for score, f in zip(scores, row.tolist()) if score is not None]
        stats.pcar_spans += len(scored)
        stats.pcar_factor_sum += sum(scored)
        stats.pcar_factor_sq_sum += sum(f * f for f in scored)
    samples = []
    for ei, episode in enumerate(group):
        if not keep[ei]:
            continue
        # Per turn: (first token, end token or None, value) pieces over the plain advantage.
        pieces: dict[int, list[tuple[int, int | None, float]]] = {}
        for span, value in zip(spans_and_scores[ei][0], rescaled[ei].tolist()):
            for turn_index, first, end in span:
                pieces.setdefault(turn_index, []).append((first, end, value))
        for segment in episode.segments:
            token_adv = [0.0] * len(segment.token_ids)
            for turn_index, start, end in turn_spans(episode, segment):
                token_adv[start:end] = [float(group_adv[ei])] * (end - start)
                for first, last, value in pieces.get(turn_index, ()):
                    stop = end if last is None else start + last
                    token_adv[start + first:stop] = [value] * (stop - start - first)
            samples.append(_sample(segment, token_adv, gi, ei))
    return samples


def _finish(samples: list[TrainSample], stats: BatchStats) -> tuple[list[TrainSample], BatchStats]:
    stats.samples = len(samples)
    stats.trained_tokens = sum(sum(s.loss_mask) for s in samples)
    trained = [a for s in samples for a, m in zip(s.advantages, s.loss_mask) if m]
    if trained:
        stats.advantage_sum, stats.advantage_min, stats.advantage_max = float(sum(trained)), min(trained), max(trained)
    return samples, stats


def trained_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """The flat indices of the positions a ``[rows, L - 1]`` loss mask trains; the update computes
    log-probs there only (built on the host, so the device never has to report the count)."""
    return torch.nonzero(loss_mask.reshape(-1)).view(-1)


def empty_rows(rows: int, width: int, pad_id: int) -> dict[str, torch.Tensor]:
    """``input_ids`` ``[rows, width]`` of padding, and zero ``loss_mask``, ``old_logprobs`` and
    ``advantages`` ``[rows, width - 1]``, for :func:`place_sample` to fill."""
    return {"input_ids": torch.full((rows, width), pad_id, dtype=torch.long),
            **{key: torch.zeros((rows, width - 1)) for key in ("loss_mask", "old_logprobs", "advantages")}}


def place_sample(tensors: dict[str, torch.Tensor], row: int, start: int, sample: TrainSample) -> slice:
    """Write ``sample`` into ``row`` from position ``start``. Position p predicts token p + 1, so
    per-token values move one place left; the sample's last position predicts whatever follows
    it and stays masked. Returns the positions that predict the sample's own tokens."""
    n = len(sample.token_ids)
    tensors["input_ids"][row, start:start + n] = torch.tensor(sample.token_ids)
    span = slice(start, start + n - 1)
    tensors["loss_mask"][row, span] = torch.tensor(sample.loss_mask[1:], dtype=torch.float32)
    tensors["old_logprobs"][row, span] = torch.tensor(sample.old_logprobs[1:], dtype=torch.float32)
    tensors["advantages"][row, span] = torch.tensor(sample.advantages[1:], dtype=torch.float32)
    return span


def collate(samples: list[TrainSample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples into tensors; targets are the next tokens (shifted by one);
    ``trained_index``: see :func:`trained_index`."""
    width = max(len(s.token_ids) for s in samples)
    tensors = empty_rows(len(samples), width, pad_id)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        place_sample(tensors, row, 0, sample)
        attention[row, :len(sample.token_ids)] = 1
    return {**tensors, "attention_mask": attention, "targets": tensors["input_ids"][:, 1:].contiguous(),
            "trained_index": trained_index(tensors["loss_mask"])}


def evaluation_split(policy) -> Callable:
    """PCAR's ``split_tokens``: how many of a turn's sampled tokens its evaluation spans (the
    env's ``evaluation_end`` character offset, mapped through the policy's tokenizer), or None."""
    def split_tokens(turn) -> int | None:
        end = turn.info.get(PROCESS_SPLIT_KEY)
        if end is None or not turn.sampled_ids:
            return None
        if not is_int(end) or not 0 <= end <= len(turn.action):
            raise EnvContractError(f"info[{PROCESS_SPLIT_KEY!r}] is {end!r}; it is a character "
                                   f"offset into the turn's action, an int in [0, {len(turn.action)}]")
        if not turn.action[end:].strip():
            # Nothing but white space after the evaluation: the whole turn is its span. Mapped to
            # tokens, the offset would fall before the sampled stop token, which would then go to
            # the next span.
            return None
        return tokens_covering(policy.chat.decode_reply, list(turn.sampled_ids), int(end))
    return split_tokens
