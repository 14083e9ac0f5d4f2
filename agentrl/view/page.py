"""The viewer's one HTML page, its CSS and script inlined (no CDN: clusters often have no internet).

Served, the page fetches the API; exported, the same page carries the run's data and every shown
sample's markup inside it, so the file alone is the report.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

MARKERS = re.compile(r"/\*(?:STYLE|SCRIPT|DATA)\*/|<!--(?:TITLE|SAMPLES)-->")


def _asset(name: str) -> str:
    return resources.files("agentrl.view").joinpath("static", name).read_text(encoding="utf-8")


def embed_json(data: Any) -> str:
    """JSON safe inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` can close the tag."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(*, title: str, data: Any = None, static_samples: str = "") -> str:
    """The page; with ``data`` (see :mod:`agentrl.view.export`) it needs no server."""
    import html

    from agentrl.view.tokens import provenance_css

    values = {"/*STYLE*/": _asset("style.css") + provenance_css(), "/*SCRIPT*/": _asset("app.js"), "<!--TITLE-->": html.escape(title),
              "/*DATA*/": embed_json(data), "<!--SAMPLES-->": static_samples}
    # One pass over the template: a value (a run's name, a sample) is never searched for markers.
    return MARKERS.sub(lambda m: values[m.group(0)], _asset("index.html"))
