"""The policy-gradient trainer: pure advantage and loss functions, and a readable loop."""

from .config import ALGORITHMS, TrainConfig

__all__ = ["ALGORITHMS", "TrainConfig", "train", "load_trained"]


def __getattr__(name):
    # The loop needs torch; importing the package for its config should not.
    if name == "train":
        from .loop import train

        return train
    if name == "load_trained":
        from .export import load_trained

        return load_trained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
