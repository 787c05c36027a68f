"""Which tasks a training step draws.

An env that serves a dataset by seed (item ``seed % size``: CodeTCG, VerifiableQA and
SearchEvalQA with a dataset and ``task_selection="seed"``) is trained in epochs, as TRL and verl
go through a dataset: each epoch visits every item once, in an order shuffled afresh per epoch,
and a step takes the next ``tasks_per_step`` items (an epoch's last step runs into the next). The
order follows from the run's seed and the step alone, so a resumed run draws what the
uninterrupted one would have. An env without such a dataset (a seeded generator) gets random
seeds from the run's task RNG instead.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def epoch_task_seeds(seed: int, size: int, first: int, count: int) -> list[int]:
    """The seeds of the run's tasks ``first`` to ``first + count - 1`` (counted over the whole run)
    over a dataset of ``size`` items: task ``p`` is item ``order_e[p % size]`` of epoch
    ``e = p // size``, whose order is a permutation drawn from ``(seed, e)``. Its seed is that item
    plus ``e * size``: the env serves the item (``seed % size``), and each epoch's episodes of it
    are new ones (their other draws differ)."""
    orders: dict[int, np.ndarray] = {}
    seeds = []
    for position in range(first, first + count):
        epoch, offset = divmod(position, size)
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(size)
        seeds.append(int(orders[epoch][offset]) + epoch * size)
    return seeds


def served_dataset_size(make_env: Callable) -> int | None:
    """The size of the dataset an env ``make_env`` makes serves by seed (its ``eval_episodes``),
    or None (a generator, or an env that does not say): from one env made and closed for it."""
    env = make_env()
    try:
        size = getattr(env.unwrapped, "eval_episodes", None)
    finally:
        env.close()
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
