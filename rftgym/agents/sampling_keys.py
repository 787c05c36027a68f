"""Keyed sampling: a seeded episode samples the same whatever else shares its batch.

A seeded policy that draws from one generator for the whole batch gives an episode other samples
as soon as other episodes share its batch: another ``--num-envs``, another number of GPUs, a
neighbour that finished a turn earlier. With keys, each reply draws from a stream of its own,
seeded by the policy's seed and the reply's key. The rollout engine keys a reply by its episode
and turn, ``(*episode key, turn)``, where an episode's key is by default

    (kind, task seed or episode index, repeat)

``repeat`` counts the earlier episodes of the call with the same task seed (a GRPO group runs its
task G times, and each of its episodes must sample differently). So ``rftgym eval --seed 5
--episodes 1`` replays episode 5 of ``--seed 0 --episodes 10`` token for token. The trainer gives
its own episode keys, ``(step, task index, member of the group)``, counted over all ranks.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from ..core.values import is_int

SampleKey = tuple[int, ...]

# The key's kind: a task seed, a negative task seed (negated, SeedSequence takes no negatives),
# or no task seed at all (keyed by the episode's index in the call).
_SEEDED, _NEGATIVE_SEED, _UNSEEDED = 1, 2, 3


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


def check_key(key, what: str = "a sample key") -> SampleKey:
    """``key`` as a tuple of non-negative ints, or a TypeError/ValueError that says what it was."""
    if isinstance(key, (str, bytes)) or not hasattr(key, "__iter__"):
        raise TypeError(f"{what} is a sequence of non-negative ints, got {key!r}")
    parts = tuple(key)
    if not all(is_int(part) and part >= 0 for part in parts):
        raise ValueError(f"{what} is a sequence of non-negative ints, got {key!r}")
    return tuple(int(part) for part in parts)


def keyed_uniforms(seed: int, keys: Sequence[SampleKey], count: int) -> np.ndarray:
    """``[len(keys), count]`` float64 draws from U[0, 1): row i from the stream of ``(seed, keys[i])``
    alone, so a row is the same in any batch."""
    rows = [np.random.default_rng(_seed_sequence(seed, key)).random(count) for key in keys]
    return np.stack(rows) if rows else np.zeros((0, count))


def keyed_seed(seed: int, key: SampleKey) -> int:
    """One 31-bit seed from ``(seed, key)`` (for a server's per-request ``seed``; 31 bits because
    some servers read it as a signed 32-bit integer)."""
    return int(_seed_sequence(seed, key).generate_state(1, np.uint32)[0]) >> 1


def _seed_sequence(seed: int, key: SampleKey) -> np.random.SeedSequence:
    if not is_int(seed) or seed < 0:
        raise ValueError(f"a sampling seed is a non-negative int, got {seed!r}")
    return np.random.SeedSequence([int(seed), *check_key(key)])
