"""Agents: anything that maps a chat context to the next assistant turn.

``HFPolicy`` (local transformers model) and ``ChatAPIAgent`` (OpenAI-compatible server) are
imported from their modules, so that importing this package never needs torch.
"""

from .base import Agent, AgentReply
from .scripted import AdversarialAgent, RandomTextAgent, ScriptedAgent

__all__ = ["Agent", "AgentReply", "ScriptedAgent", "RandomTextAgent", "AdversarialAgent"]
