"""The config reference (``docs/config.md``), generated from the models so it cannot go stale:
``python -m agentrl.run.reference > docs/config.md``; a test compares the file with this output."""

from __future__ import annotations

import json
import sys
from typing import Any

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
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return (text or str(annotation).replace("typing.", "")).replace("NoneType", "None")


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else json.dumps(value)
    return "" if field.default is PydanticUndefined else json.dumps(field.default)


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    out += [f"\n## `{prefix or 'top level'}` ({model.__name__})\n", "| field | type | default | meaning |",
            "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((f"{prefix}{name}", annotation))
            continue
        doc = (field.description or "").replace("|", "\\|")
        kind = _type(annotation).replace("|", "\\|")
        out.append(f"| `{prefix}{name}` | `{kind}` | `{_default(field)}` | {doc} |")
    for path, sub in nested:
        _section(sub, f"{path}.", out)


def config_reference() -> str:
    out = [HEADER.rstrip()]
    _section(RunConfig, "", out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_reference())
