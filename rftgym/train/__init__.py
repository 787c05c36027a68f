"""The policy-gradient trainer: pure advantage and loss functions, and a readable loop."""

from .config import ALGORITHMS, TrainConfig

__all__ = ["ALGORITHMS", "TrainConfig", "train"]


def __getattr__(name):
    # The loop needs torch; importing the package for its config should not.
    if name == "train":
        from .loop import train

        return train
    raise AttributeError(name)
