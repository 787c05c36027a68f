"""Keyed sampling: a seeded episode samples the same whatever else shares its batch.

A seeded policy that draws from one generator for the whole batch gives an episode other samples
as soon as other episodes share its batch: another ``--num-envs``, another number of GPUs, a
neighbour that finished a turn earlier. With keys, each reply draws from a stream of its own,
seeded by the policy's seed and the reply's key. The rollout engine keys a reply by its episode
and turn, ``(*episode key, turn)``, where an episode's key is by default

    (kind, task seed, repeat)    or, for an episode without a task seed,    (kind, episode index)

``repeat`` counts the earlier episodes of the call with the same task seed (a GRPO group runs its
task G times, and each of its episodes must sample differently). So ``rftgym eval --seed 5
--episodes 1`` draws for its episode what ``--seed 0 --episodes 10`` drew for episode 5 (under the
same ``--sample-seed``). The trainer gives its own episode keys (:func:`training_keys`: step, task
index over all ranks, member of the group).

Unkeyed draws (replies asked for without keys) come from an agent's own stream, apart from every
reply's key (the ``UNKEYED`` domain). A call given a seed of its own draws row i of its batch from
``(seed, (i,))`` in that domain (:func:`call_uniforms`), so the same call with the same seed
samples the same.

The draws are the episode's own; its tokens are the same wherever the model's logits are. Logits
are not quite batch-invariant: a batch's left padding and size change how the kernels block their
sums (as does prefix reuse, which prefills fewer tokens), so the same prompt's log-probs may differ
in their last bits (up to 3e-5 in float32 on a CPU for the default model, more in bfloat16 on a
GPU, where kernels are also chosen by batch size). That flips a token when its draw lies that close
to a boundary between two tokens of the cumulative distribution: mostly where the draw falls among
the long tail of very unlikely tokens, whose intervals are narrower than that error
(``benchmarks/sampling_invariance.py``: at temperature 1, 3 to 5 of 32 VerifiableQA episodes
diverged somewhere in ~3,000 tokens). The tests compare tokens across batches on short runs of a
tiny model, where no draw lands that close.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from ..core.values import is_int

SampleKey = tuple[int, ...]

# The key's kind: a task seed, a negative task seed (negated, SeedSequence takes no negatives),
# no task seed at all (keyed by the episode's index in the call), or a training episode.
_SEEDED, _NEGATIVE_SEED, _UNSEEDED, _TRAINING = 1, 2, 3, 4

# What a stream is for: a keyed reply, or an agent's own stream for replies given no key.
REPLY, UNKEYED = 0, 1
_ENCODING = 1  # the layout of the words below, in case it ever changes


def episode_keys(seeds: Sequence[int | None]) -> list[SampleKey]:
    """The default key of each episode of a rollout over ``seeds`` (the engine appends the turn)."""
    repeats: Counter = Counter()
    keys = []
    for index, seed in enumerate(seeds):
        if not is_int(seed):  # None, or something reset will refuse with its own message
            keys.append((_UNSEEDED, index))
            continue
        seed = int(seed)
        keys.append((_SEEDED if seed >= 0 else _NEGATIVE_SEED, abs(seed), repeats[seed]))
        repeats[seed] += 1
    return keys


def training_keys(step: int, tasks: Sequence[int], group_size: int) -> list[SampleKey]:
    """The keys of a training step's episodes: ``tasks`` are the indices (over all ranks) of the
    tasks this rank runs, each ``group_size`` times, in that order."""
    return [(_TRAINING, step, task, member) for task in tasks for member in range(group_size)]


def check_key(key, what: str = "a sample key") -> SampleKey:
    """``key`` as a tuple of non-negative ints, or a TypeError/ValueError that says what it was."""
    if isinstance(key, (str, bytes)) or not hasattr(key, "__iter__"):
        raise TypeError(f"{what} is a sequence of non-negative ints, got {key!r}")
    parts = tuple(key)
    if not all(is_int(part) and part >= 0 for part in parts):
        raise ValueError(f"{what} is a sequence of non-negative ints, got {key!r}")
    return tuple(int(part) for part in parts)


def keyed_generator(seed: int, key: SampleKey, domain: int = REPLY) -> np.random.Generator:
    """The stream of one keyed reply: a generator seeded by ``(seed, key)`` alone (in ``domain``)."""
    return np.random.default_rng(_seed_sequence(seed, key, domain))


def keyed_uniforms(seed: int, keys: Sequence[SampleKey], count: int, domain: int = REPLY) -> np.ndarray:
    """``[len(keys), count]`` float64 draws from U[0, 1): row i from the stream of ``(seed, keys[i])``
    alone, so a row is the same in any batch."""
    rows = [keyed_generator(seed, key, domain).random(count) for key in keys]
    return np.stack(rows) if rows else np.zeros((0, count))


def call_uniforms(seed: int, rows: int, count: int) -> np.ndarray:
    """The draws of one unkeyed call made with a seed of its own, ``[rows, count]``: row i from
    ``(seed, (i,))`` in the ``UNKEYED`` domain, so the call replays under the same seed and no
    keyed reply shares a stream with it."""
    return keyed_uniforms(seed, [(row,) for row in range(rows)], count, UNKEYED)


def keyed_seed(seed: int, key: SampleKey, domain: int = REPLY) -> int:
    """One 31-bit seed from ``(seed, key)`` in ``domain`` (for a server's per-request ``seed``; 31
    bits because some servers read it as a signed 32-bit integer)."""
    return int(_seed_sequence(seed, key, domain).generate_state(1, np.uint32)[0]) >> 1


def _seed_sequence(seed: int, key: SampleKey, domain: int) -> np.random.SeedSequence:
    """SeedSequence pads its input with zeros and cuts big ints into 32-bit words, so (5,) and
    (5, 0), or a seed of 2**32 + 9 and one of 9, would share a stream if handed in as they are.
    Each number goes in as its count of 32-bit words and then the words, after the key's length:
    no two (seed, key, domain) give the same words, even padded."""
    if not is_int(seed) or seed < 0:
        raise ValueError(f"a sampling seed is a non-negative int, got {seed!r}")
    key = check_key(key)
    words = [_ENCODING, domain]
    for number in (int(seed), len(key), *key):
        words += _words(number)
    return np.random.SeedSequence(words)


def _words(number: int) -> list[int]:
    """``number`` (>= 0) as [count, its 32-bit words from the lowest]."""
    parts = [number & 0xFFFFFFFF]
    number >>= 32
    while number:
        parts.append(number & 0xFFFFFFFF)
        number >>= 32
    return [len(parts), *parts]
