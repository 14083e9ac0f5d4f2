"""The viewer's HTTP API (FastAPI) over one :class:`~agentrl.view.run_dir.RunDir`, and its page.

Every parameter is typed (a step is an int, a page size is bounded), so no request names a file: the
server reads only the run's own step files, metrics log and checkpoint names.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse

from agentrl.trajectory import DRIFT_OUTCOMES, STATUSES, TURN_OUTCOMES, Sample, StopReason
from agentrl.view.filters import MAX_PAGE, SampleFilter
from agentrl.view.page import render_page
from agentrl.view.run_dir import RunDir
from agentrl.view.tokens import PROVENANCE_CLASSES, Decoder, render_sample


def vocabulary() -> dict[str, Any]:
    """The names the page's legend and filters offer, read from the trajectory module."""
    return {"classes": PROVENANCE_CLASSES, "statuses": list(STATUSES), "outcomes": list(TURN_OUTCOMES),
            "drift_outcomes": list(DRIFT_OUTCOMES), "stop_reasons": [str(r) for r in StopReason]}


def run_summary(run: RunDir, *, read_all: bool = False) -> dict[str, Any]:
    """Steps, checkpoints and names. A step's count and errors are known once it was read (``read_all``:
    read every step now; the served page reads a step only when it is shown)."""
    steps = []
    for step in run.steps():
        index = run.index(step) if read_all else run.indexed(step)
        steps.append({"step": step, "samples": None if index is None else len(index.summaries),
                      "errors": [] if index is None else index.errors})
    return {"name": run.root.name, "steps": steps, "checkpoints": run.checkpoints(), **vocabulary()}


def rendered(run: RunDir, step: int, index: int, decode: Decoder) -> dict[str, Any]:
    return {"summary": run.index(step).summaries[index].public(),
            "html": render_sample(Sample.from_dict(run.sample(step, index)), decode)}


def make_router(run: RunDir, decode: Decoder) -> APIRouter:
    api = APIRouter(prefix="/api")

    def step_index(step: int):
        try:
            return run.index(step)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        except OSError as exc:
            raise HTTPException(500, f"step {step}: cannot read its samples ({exc.strerror or exc})") from None

    @api.get("/run")
    def get_run() -> dict[str, Any]:
        return run_summary(run)

    @api.get("/metrics")
    def get_metrics() -> dict[str, Any]:
        rows, errors = run.metrics()
        return {"rows": rows, "errors": errors}

    @api.get("/steps/{step}/samples")
    def list_samples(step: int, filters: Annotated[SampleFilter, Depends()],
                     offset: Annotated[int, Query(ge=0)] = 0,
                     limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100) -> dict[str, Any]:
        index = step_index(step)
        kept = [s for s in index.summaries if filters.keeps(s)]
        return {"step": step, "total": len(kept), "offset": offset, "limit": limit, "errors": index.errors,
                "items": [s.public() for s in kept[offset:offset + limit]]}

    @api.get("/steps/{step}/samples/{index}")
    def get_sample(step: int, index: int) -> dict[str, Any]:
        step_index(step)
        try:
            return rendered(run, step, index, decode)
        except IndexError as exc:
            raise HTTPException(404, str(exc)) from None
        except ValueError as exc:  # the file changed under us and that line is bad now
            raise HTTPException(422, str(exc)) from None

    return api


def create_app(run: RunDir, decode: Decoder, *, allowed_hosts: list[str] | None = None) -> FastAPI:
    """The viewer app; ``allowed_hosts`` (default: loopback names) guards against DNS rebinding."""
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    app = FastAPI(title="agentrl view", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware,
                       allowed_hosts=allowed_hosts or ["127.0.0.1", "localhost", "[::1]", "::1"])
    app.include_router(make_router(run, decode))
    page = render_page(title=f"agentrl view: {run.root.name}")

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return page

    return app
