"""The run's engine secret: what weight-update and control routes of engines and the router require.

Sent as ``Authorization: Bearer <secret>``, the header real SGLang checks for its ``--api-key`` and smg
sends to a worker registered with an ``api_key``. It travels to child processes in the environment
variable :data:`SECRET_ENV` (never on a command line, which every local user can read in ``/proc``).

:func:`run_secret` is this process's secret: ``$AGENTRL_ENGINE_SECRET`` when set, else a fresh random
one stored there on first use, so the engines, the router and the weight-sync clients a process starts
share one secret without passing it around, and processes it spawns (or a Ray job given the variable)
inherit it.
"""

from __future__ import annotations

import os
import secrets

SECRET_ENV = "AGENTRL_ENGINE_SECRET"


def run_secret() -> str:
    """This process's engine secret (see module doc); created with :func:`secrets.token_urlsafe` if unset."""
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        secret = secrets.token_urlsafe(32)
        os.environ[SECRET_ENV] = secret
    return secret


def auth_headers(secret: str | None) -> dict[str, str]:
    """The request headers that present ``secret`` (none for ``None``)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def secret_matches(presented: str | None, secret: str) -> bool:
    """Constant-time comparison, so response timing does not leak how much of a guess was right."""
    return presented is not None and secrets.compare_digest(presented.encode(), secret.encode())
