"""The one plug-in loader: every configurable point (environment, tasks, expert, drift policy, credit /
advantage / loss functions, sample and group filters, rewards, weight-sync payloads and transports) names
its object the same way.

A path is ``"package.module:attr"`` or ``"package.module.attr"``; attribute chains work after the colon
(``"pkg.mod:Class.method"``). Wherever agentrl has built-in names (``"realign"``, ``"delta"``), a path to
the user's own object is accepted too: :func:`resolve` looks the name up first, then loads it as a path.
This module is stdlib only, so every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


class PluginError(ImportError, ValueError):
    """A plug-in path that does not name what it should: the message says what was looked up.

    An ``ImportError`` (the module or attribute is missing) and a ``ValueError`` (a bad config value)."""


class PluginTypeError(PluginError, TypeError):
    """A plug-in path that names an object of the wrong kind (not callable, not the base class asked for).

    Also a ``ValueError``, so config validation reports it with the key's path like any bad value."""


def split_path(path: str) -> tuple[str, str]:
    """``"pkg.mod:attr.sub"`` or ``"pkg.mod.attr"`` -> (module, attribute path); ``PluginError`` if neither."""
    if not isinstance(path, str) or not path.strip():
        raise PluginError(f"plug-in path must be 'package.module:function', got {path!r}")
    module_name, sep, attr_path = path.strip().partition(":")
    if not sep:
        module_name, _, attr_path = module_name.rpartition(".")
    if not module_name or not attr_path:
        raise PluginError(f"plug-in path must be 'package.module:function', got {path!r}")
    return module_name, attr_path


def load_object(path: str) -> Any:
    """The object at ``path``; ``PluginError`` naming the module and attribute it looked for."""
    module_name, attr_path = split_path(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and not module_name.startswith(err.name):
            raise  # the plug-in module exists but one of its own imports is missing: show that
        raise PluginError(f"cannot load {path!r}: module {module_name!r} not found ({err})") from err
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"cannot load {path!r}: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def load_function(path: str) -> Callable[..., Any]:
    """The callable at ``path`` (a function or a class); :class:`PluginTypeError` if it is not callable."""
    obj = load_object(path)
    if not callable(obj):
        raise PluginTypeError(f"{path!r} is a {type(obj).__name__}, not a function")
    return obj


def resolve(name_or_path: Any, builtins: Mapping[str, Any], *, what: str, base: type | None = None) -> Any:
    """A built-in ``name`` (``builtins[name]``, itself an object or a path), else the object at the path.

    ``base``: the loaded object must be a subclass of it (or an instance, for an object passed in).
    Errors name ``what`` the point is and list the built-in names."""
    if base is not None and isinstance(name_or_path, base):
        return name_or_path
    if isinstance(name_or_path, type) and (base is None or issubclass(name_or_path, base)):
        return name_or_path
    if not isinstance(name_or_path, str):
        raise PluginTypeError(f"{what} must be one of {sorted(builtins)} or a 'module:attr' path, "
                        f"got {type(name_or_path).__name__}")
    if name_or_path in builtins:
        target = builtins[name_or_path]
        obj = load_object(target) if isinstance(target, str) else target
    elif ":" in name_or_path or "." in name_or_path:
        obj = load_object(name_or_path)
    else:
        raise PluginError(f"unknown {what} {name_or_path!r}; choose from {sorted(builtins)} or give 'module:attr'")
    if base is not None and not (isinstance(obj, type) and issubclass(obj, base)):
        raise PluginTypeError(f"{what} {name_or_path!r} is not a {base.__name__} subclass")
    return obj
