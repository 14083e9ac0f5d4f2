"""``Settings``: the base of every config section (run, rollout, warm-up, trainer, loss).

A section is a typed pydantic model that refuses unknown keys at load time, naming the key, its section
and the nearest valid key ("did you mean lr?"), so a typo never reaches a Ray actor. Stdlib + pydantic
only, so every layer may use it.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator

from agentrl.plugins import load_function


def _loads(path: str) -> str:
    load_function(path)
    return path


# A config field naming a plug-in function: loaded at validation, so a bad path fails at config load
# with the module and attribute it looked for.
FunctionPath = Annotated[str, AfterValidator(_loads)]


class Settings(BaseModel):
    """A config section: typed fields, unknown keys refused with a suggestion."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    # Keys that moved elsewhere or are set once in another section: key -> where it lives instead.
    moved_keys: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        unknown = [k for k in data if k not in known]
        if unknown:
            raise ValueError("; ".join(cls._explain(str(k), sorted(known)) for k in unknown))
        return data

    @classmethod
    def _explain(cls, key: str, known: list[str]) -> str:
        section = cls.__name__
        if key in cls.moved_keys:
            return f"unknown key {key!r} in {section}: {cls.moved_keys[key]}"
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}?" if near else f"valid keys: {', '.join(known)}"
        return f"unknown key {key!r} in {section} ({hint})"
