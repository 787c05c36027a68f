"""rftgym: a gym for reinforcement fine-tuning of LLM agents.

Importing the package registers its environments with Gymnasium::

    import gymnasium as gym
    import rftgym

    env = gym.make("rftgym/VerifiableQA-v0")
"""

from .core.messages import Context, Message
from .envs import register_envs

register_envs()

__version__ = "0.1.0"
__all__ = ["Context", "Message", "__version__"]
