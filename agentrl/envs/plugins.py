"""The agent loop's two seams, named as in slime: a *rollout function* (``rollout_function_path``) replaces
:func:`agentrl.envs.loop.generate_rollout` for a whole batch; a *per-sample generate function*
(``custom_generate_function_path``) replaces :func:`agentrl.envs.loop.run_episode` for each episode.
Both keep the signature of the function they replace and load through :mod:`agentrl.plugins`.
"""

from __future__ import annotations

from agentrl.plugins import load_function

DEFAULT_ROLLOUT_FUNCTION = "agentrl.envs.loop:generate_rollout"
DEFAULT_EPISODE_FUNCTION = "agentrl.envs.loop:run_episode"

__all__ = ["DEFAULT_EPISODE_FUNCTION", "DEFAULT_ROLLOUT_FUNCTION", "load_function"]
