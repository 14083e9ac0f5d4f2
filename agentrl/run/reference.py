"""The config reference (``docs/config.md``), generated from the models so it cannot go stale:
``python -m agentrl.run.reference > docs/config.md``; a test compares the file with this output."""

from __future__ import annotations

import json
import sys
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from agentrl.run.config import RunConfig

HEADER = """# Configuration reference

Generated from the config models by `python -m agentrl.run.reference > docs/config.md` (a test keeps it
current). Every field is set in the YAML or on the command line as `--section.field VALUE`; an unknown
key fails at load, before Ray starts, naming the nearest valid key. `agentrl train CONFIG --print-config`
prints the resolved config. Plug-in fields take `module:attr` (or `module.attr`); where built-in names
exist, a path to your own object is accepted too.
"""


def _type(annotation: Any) -> str:
    """``str | None``, ``Literal['sync', 'async']``, ``dict[str, Any]``: as a user would write it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type(args[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else json.dumps(value)
    return "(required)" if field.default is PydanticUndefined else json.dumps(field.default)


def _section(model: type[BaseModel], prefix: str, out: list[str], *, title: str | None = None,
             skip: frozenset[str] = frozenset()) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    out += [f"\n## `{prefix or 'top level'}` ({title or model.__name__})\n", "| field | type | default | meaning |",
            "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((f"{prefix}{name}", annotation))
            continue
        optional = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if optional:  # an optional section: a row saying it is off by default, then its own fields
            nested.append((f"{prefix}{name}", optional[0]))
        doc = (field.description or "").replace("|", "\\|")
        kind = _type(annotation).replace("|", "\\|")
        out.append(f"| `{prefix}{name}` | `{kind}` | `{_default(field)}` | {doc} |")
    for path, sub in nested:
        _section(sub, f"{path}.", out)


def _sync_option_sections(out: list[str]) -> None:
    """``sync_options``: the keys every payload takes, each payload's and each built-in transport's own."""
    from agentrl.weights.sync import MODES, PayloadOptions, payload_class
    from agentrl.weights.transport import TRANSPORTS, TransportOptions, transport_class

    _section(PayloadOptions, "sync_options.", out, title="every payload")
    for name in MODES:
        options = payload_class(name).Options
        if options is not PayloadOptions:
            _section(options, "sync_options.", out, title=f"the {name} payload", skip=frozenset(PayloadOptions.model_fields))
    for name in TRANSPORTS:
        _section(transport_class(name).Options, "sync_options.", out, title=f"transport: {name}",
                 skip=frozenset(TransportOptions.model_fields))


def config_reference() -> str:
    out = [HEADER.rstrip()]
    _section(RunConfig, "", out)
    _sync_option_sections(out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_reference())
