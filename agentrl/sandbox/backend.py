"""Pick a sandbox backend: Docker when an engine answers, else bubblewrap (with a logged warning)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

from agentrl.sandbox.base import Sandbox, SandboxError
from agentrl.sandbox.engine_setup import DEFAULT_IMAGE
from agentrl.sandbox.limits import SandboxLimits

log = logging.getLogger(__name__)

Backend = Literal["auto", "docker", "bwrap"]
BACKENDS = ("auto", "docker", "bwrap")


def resolve_backend(backend: str = "auto") -> str:
    """'docker' or 'bwrap'; 'auto' probes the Docker engine once."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    from agentrl.sandbox.docker_client import docker_reachable

    if docker_reachable():
        return "docker"
    from agentrl.sandbox.bwrap_sandbox import bwrap_available

    if not bwrap_available():
        raise SandboxError("no Docker engine is reachable and bubblewrap is unusable; run `agentrl sandbox setup`")
    from agentrl.sandbox.seccomp import seccomp_problem

    problem = seccomp_problem()
    if problem:
        # Without its seccomp filter the fallback is not the sandbox it claims to be: off unless asked for.
        raise SandboxError(f"no Docker engine is reachable and the bubblewrap fallback is off: no seccomp "
                           f"filter ({problem}); run `agentrl sandbox setup`, or use "
                           "BwrapSandbox(allow_unconfined=True) knowingly")
    log.warning("no Docker engine reachable: falling back to the bubblewrap sandbox backend "
                "(host /usr read-only, seccomp on, cgroup limits where writable); run `agentrl sandbox setup` "
                "for Docker")
    return "bwrap"


def make_sandbox(backend: str = "auto", *, image: str = DEFAULT_IMAGE, limits: SandboxLimits | None = None,
                 labels: Mapping[str, str] | None = None, role: str = "sandbox",
                 read_only_mounts: Mapping[str, str] | None = None) -> Sandbox:
    """An unstarted sandbox of the chosen backend (``image`` only applies to Docker)."""
    kind = resolve_backend(backend)
    if kind == "docker":
        from agentrl.sandbox.docker_sandbox import DockerSandbox

        return DockerSandbox(image, limits=limits, labels=labels, role=role, read_only_mounts=read_only_mounts)
    from agentrl.sandbox.bwrap_sandbox import BwrapSandbox

    return BwrapSandbox(limits=limits, labels=labels, role=role, read_only_mounts=read_only_mounts)
