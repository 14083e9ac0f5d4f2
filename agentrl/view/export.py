"""``agentrl view RUN_DIR --export FILE.html``: the page with the run's data inside, one file to attach.

Every exported sample is rendered into the file as static markup (its tokens carry ``data-provenance``
without any script running); the script only filters and shows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.trajectory.sample import Sample
from agentrl.view.app import run_summary
from agentrl.view.page import render_page
from agentrl.view.run_dir import RunDir
from agentrl.view.tokens import Decoder, render_sample


def export_html(run: RunDir, decode: Decoder, out: str | Path, *, max_samples: int = 200) -> dict[str, Any]:
    """Write the self-contained page to ``out``; ``max_samples`` per step (0: all). Returns counts."""
    summaries: dict[int, list[dict[str, Any]]] = {}
    articles: list[str] = []
    for step in run.steps():
        shown = run.index(step).summaries
        shown = shown[:max_samples] if max_samples > 0 else shown
        summaries[step] = [{**s.public(), "text": s.text} for s in shown]
        for s in shown:
            body = render_sample(Sample.from_dict(run.sample(step, s.index)), decode)
            articles.append(f'<article class="sample" id="s-{step}-{s.index}" data-step="{step}" '
                            f'data-index="{s.index}" hidden>{body}</article>')
    rows, errors = run.metrics()
    data = {"run": run_summary(run, read_all=True), "metrics": {"rows": rows, "errors": errors}, "samples": summaries}
    page = render_page(title=f"agentrl view: {run.root.name}", data=data,
                       static_samples="\n".join(articles))
    Path(out).write_text(page, encoding="utf-8")
    return {"steps": len(summaries), "samples": len(articles), "bytes": len(page.encode())}
