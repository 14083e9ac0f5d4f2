"""Split a docstring into its summary and per-argument descriptions (Google or NumPy style).

Only what a tool schema needs is extracted: the text before the first section header, and for each
parameter the text that documents it. Sections other than the argument section are ignored.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

_GOOGLE_ARGS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments"}
_GOOGLE_OTHER = {"returns", "return", "yields", "raises", "examples", "example", "notes", "note", "see also",
                 "attributes", "warnings", "warning", "references", "todo"}
_NUMPY_UNDERLINE = re.compile(r"^\s*-{3,}\s*$")
# "name (type): text", "name: text", "*name: text"
_GOOGLE_ITEM = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(\([^)]*\))?\s*:\s*(?P<text>.*)$")
# "name : type" or a bare "name"
_NUMPY_ITEM = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(:.*)?$")


@dataclass
class ParsedDocstring:
    summary: str = ""
    params: dict[str, str] = field(default_factory=dict)


def parse_docstring(doc: str | None) -> ParsedDocstring:
    """Summary (first paragraphs before any section) and ``{argument: description}``."""
    if not doc:
        return ParsedDocstring()
    lines = inspect.cleandoc(doc).splitlines()
    sections, numpy_headers = _split_sections(lines)
    summary = " ".join(" ".join(sections.get("", [])).split())
    params: dict[str, str] = {}
    for header, body in sections.items():
        if header in _GOOGLE_ARGS:
            params.update(_parse_items(body, numpy=header in numpy_headers))
    return ParsedDocstring(summary=summary, params=params)


def _split_sections(lines: list[str]) -> tuple[dict[str, list[str]], set[str]]:
    """Lines per lower-cased section header ("" before the first one), and which headers were NumPy-style."""
    sections: dict[str, list[str]] = {"": []}
    numpy_headers: set[str] = set()
    current = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        key = stripped.rstrip(":").lower()
        if stripped and not line.startswith((" ", "\t")) and _NUMPY_UNDERLINE.match(nxt):
            current = key  # NumPy: "Parameters" followed by "----------"
            numpy_headers.add(key)
            sections.setdefault(current, [])
            i += 2
            continue
        if stripped.endswith(":") and not line.startswith((" ", "\t")) and key in _GOOGLE_ARGS | _GOOGLE_OTHER:
            current = key  # Google: "Args:"
            sections.setdefault(current, [])
            i += 1
            continue
        sections[current].append(line)
        i += 1
    return sections, numpy_headers


def _parse_items(body: list[str], *, numpy: bool) -> dict[str, str]:
    """Items start at the smallest indentation of the section; deeper lines continue the item."""
    content = [ln for ln in body if ln.strip()]
    if not content:
        return {}
    base = min(len(ln) - len(ln.lstrip()) for ln in content)
    items: dict[str, list[str]] = {}
    name: str | None = None
    for line in body:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        text = line.strip()
        if indent == base:
            google = None if numpy else _GOOGLE_ITEM.match(text)
            numpy_item = _NUMPY_ITEM.match(text) if numpy else None
            if google:
                name = google.group("name")
                items[name] = [google.group("text")]
            elif numpy_item:
                name = numpy_item.group("name")
                items[name] = []
            else:
                name = None
        elif name is not None:
            items[name].append(text)
    return {k: " ".join(" ".join(v).split()) for k, v in items.items()}
