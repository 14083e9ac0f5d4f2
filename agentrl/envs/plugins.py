"""Plug-in points: load a user's function from a dotted path, so the loop can be replaced without forking.

Two seams, named as in slime: a *rollout function* (``rollout_function_path``) replaces
:func:`agentrl.envs.loop.generate_rollout` for a whole batch; a *per-sample generate function*
(``custom_generate_function_path``) replaces :func:`agentrl.envs.loop.run_episode` for each episode.
Both keep the signature of the function they replace.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

DEFAULT_ROLLOUT_FUNCTION = "agentrl.envs.loop:generate_rollout"
DEFAULT_EPISODE_FUNCTION = "agentrl.envs.loop:run_episode"


def load_function(path: str) -> Callable[..., Any]:
    """The callable at ``"package.module:function"`` (or ``"package.module.function"``).

    Attribute chains work after the colon (``"pkg.mod:Class.method"``). Errors say what was looked up.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"function path must be 'package.module:function', got {path!r}")
    module_name, sep, attr_path = path.strip().partition(":")
    if not sep:
        module_name, _, attr_path = module_name.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"function path must be 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ImportError(f"cannot load {path!r}: module {module_name!r} not found ({err})") from err
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"cannot load {path!r}: {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise TypeError(f"{path!r} is a {type(obj).__name__}, not a function")
    return obj
