"""How a minibatch splits into forward/backward passes (gradient accumulation).

The gradient is the same whatever the split (the loop weighs each pass's loss by its share of the
minibatch's normalizer); the split only bounds a pass's activation memory and decides how much of
it is padding. Two ways to size a pass:

- ``samples_per_pass`` (``TrainConfig.microbatch_size``): a fixed number of samples. Samples are
  sorted by length first, so samples of like length share a pass and little of it is padding.
- ``tokens_per_pass`` (``TrainConfig.microbatch_tokens``, verl's dynamic batch size): as many
  samples as fit a budget of tokens computed, padding included (:func:`pass_tokens`), so a pass
  of short samples holds many and a pass of long ones few. A sample longer than the budget gets
  a pass of its own.
"""

from __future__ import annotations

from .packing import pack_rows


def pass_tokens(lengths: list[int], packed: bool) -> int:
    """Tokens a pass over samples of these lengths computes: rows x width, where the width is the
    longest sample and the rows are one per sample (padded) or as many as first-fit decreasing
    packing needs (:func:`~rftgym.train.packing.pack_rows`)."""
    if not lengths:
        return 0
    width = max(lengths)
    return (len(pack_rows(lengths, width)) if packed else len(lengths)) * width


def plan_passes(lengths: list[int], *, samples_per_pass: int = 0, tokens_per_pass: int = 0,
                packed: bool = False) -> list[list[int]]:
    """The indices (into ``lengths``) of the samples each pass takes; every index exactly once.

    With neither limit, or when every sample fits one pass of ``samples_per_pass``, one pass in
    the given order. Otherwise samples go shortest first (ties in the given order); a pass takes
    ``samples_per_pass`` of them, or, with ``tokens_per_pass``, as many of the next samples as
    keep :func:`pass_tokens` within the budget.
    """
    if samples_per_pass and tokens_per_pass:
        raise ValueError("size passes by samples or by tokens, not both")
    if not lengths:
        return []
    if tokens_per_pass <= 0 and (samples_per_pass <= 0 or len(lengths) <= samples_per_pass):
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if samples_per_pass:
        return [order[i:i + samples_per_pass] for i in range(0, len(order), samples_per_pass)]
    passes: list[list[int]] = []
    start = 0
    while start < len(order):
        # The longest run of the next samples whose pass fits the budget (at least one sample),
        # found by bisection: a pass's tokens grow with the samples it takes, and packing a pass
        # costs more than a comparison, so this packs O(log n) candidate passes, not n.
        def fits(count: int) -> bool:
            return pass_tokens([lengths[i] for i in order[start:start + count]], packed) <= tokens_per_pass
        low, high = 1, len(order) - start
        while low < high:
            middle = (low + high + 1) // 2
            if fits(middle):
                low = middle
            else:
                high = middle - 1
        passes.append(order[start:start + low])
        start += low
    return passes
