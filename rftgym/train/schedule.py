"""The learning rate of each training step: linear warm-up, then constant, linear or cosine decay.

A pure function of the step, so a resumed run continues the schedule exactly with no scheduler
state to save. Every optimizer update of a step (epochs x minibatches) uses that step's rate, as
verl steps its actor scheduler once per training step.
"""

from __future__ import annotations

import math

from ..core.errors import ConfigError

LR_SCHEDULES = ("constant", "linear", "cosine")


def learning_rate_at(step: int, *, base: float, total_steps: int, schedule: str = "constant",
                     warmup_steps: int = 0, min_ratio: float = 0.0) -> float:
    """The learning rate of 0-based ``step`` of ``total_steps``::

        warm-up (step < W):  base * (step + 1) / W
        after it:            p = (step - W) / (total_steps - W)        (0 at the first step after warm-up)
            constant:        base
            linear:          base * (min_ratio + (1 - min_ratio) * (1 - p))
            cosine:          base * (min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2)

    The first warm-up step already trains (at ``base / W``, not 0), and the decay reaches
    ``base * min_ratio`` one step after the last (``p`` of the last step is ``1 - 1 / (total - W)``),
    so no step is wasted at a zero rate.
    """
    if schedule not in LR_SCHEDULES:
        raise ConfigError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}; got {schedule!r}")
    if not 0 <= warmup_steps <= total_steps:
        raise ConfigError(f"warmup_steps must be in [0, steps] = [0, {total_steps}], got {warmup_steps}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1] (the final rate as a share of the base), got {min_ratio}")
    if step < warmup_steps:
        return base * (step + 1) / warmup_steps
    if schedule == "constant":
        return base
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        share = 1.0 - progress
    else:
        share = (1.0 + math.cos(math.pi * progress)) / 2.0
    return base * (min_ratio + (1.0 - min_ratio) * share)
