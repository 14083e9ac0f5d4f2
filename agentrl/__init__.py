"""agentrl: reinforcement-learning post-training for multi-turn, tool-using LLM agents.

Importing ``agentrl`` is cheap on purpose: heavy dependencies (torch, megatron, ray, docker, sglang)
are imported only by the modules that need them.
"""

__version__ = "0.1.0"
