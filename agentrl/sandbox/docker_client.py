"""One shared docker SDK client (thread-safe connection pool) and engine checks."""

from __future__ import annotations

import threading

from agentrl.sandbox.base import SandboxError

_lock = threading.Lock()
_client = None


def docker_client():
    """The process-wide ``docker.DockerClient`` (from the environment: $DOCKER_HOST or the socket)."""
    global _client
    with _lock:
        if _client is None:
            try:
                import docker
            except ImportError as exc:
                raise SandboxError("the docker SDK is not installed: pip install 'agentrl[sandbox]'") from exc
            try:
                _client = docker.from_env(timeout=120, max_pool_size=64)
            except docker.errors.DockerException as exc:
                raise SandboxError(f"no Docker engine reachable ({exc}); run `agentrl sandbox setup`") from exc
        return _client


def docker_reachable() -> bool:
    try:
        return bool(docker_client().ping())
    except Exception:
        return False
