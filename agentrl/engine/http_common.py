"""What every route of the engine's HTTP server shares: the error body, the JSON body reader, the bearer check."""

import json
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from agentrl.engine.auth import SECRET_ENV, secret_matches
from agentrl.engine.protocol import BadRequest

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine

# Module level and no PEP 563 here: FastAPI reads SecretGuard.__call__'s annotation as an object.
BearerToken = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


def error_body(message: str, status: int) -> dict[str, Any]:
    """The engine's error JSON: ``{"error": {"message": ..., "code": status}}``."""
    return {"error": {"message": message, "code": status}}


def error_response(engine: "Engine", message: str, status: int = 400) -> JSONResponse:
    """An error answer; a 4xx counts as a bad request in the engine's metrics."""
    if 400 <= status < 500:
        engine.metrics.bad_requests.inc()
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def failure_response(engine: "Engine", message: str, status: int = 400) -> JSONResponse:
    """An error answer that also carries SGLang's update-endpoint shape ``{"success": false, "message": ...}``."""
    if 400 <= status < 500:
        engine.metrics.bad_requests.inc()
    return JSONResponse({**error_body(message, status), "success": False, "message": message}, status_code=status)


def parse_json_object(raw: bytes, *, optional: bool = False) -> dict[str, Any]:
    """A request body as a JSON object (``optional``: an empty or non-object body is ``{}``); else BadRequest."""
    if not raw.strip():
        if optional:
            return {}
        raise BadRequest("empty request body: a JSON object is required")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict) and not optional:
        raise BadRequest("the request body must be a JSON object")
    return body if isinstance(body, dict) else {}


async def read_json(request: Request, *, optional: bool = False) -> dict[str, Any]:
    """The request's body as a JSON object (see :func:`parse_json_object`)."""
    return parse_json_object(await request.body(), optional=optional)


class SecretGuard:
    """The dependency of control routes: ``Authorization: Bearer <secret>`` or a 401 (no secret: always 401)."""

    def __init__(self, secret: str | None) -> None:
        self.secret = secret

    async def __call__(self, credentials: BearerToken) -> None:
        if self.secret is None:
            raise BadRequest(f"control routes are disabled: this engine was started without a secret "
                             f"(set {SECRET_ENV})", 401)
        if credentials is None or not secret_matches(credentials.credentials, self.secret):
            raise BadRequest("this route needs the run's secret as 'Authorization: Bearer <secret>'", 401)
