"""Sandboxes for model-written code: Docker containers (or bubblewrap) with hard limits, a pre-warmed
pool, and a grader that runs hidden tests in a fresh sandbox.

Names are imported lazily so ``import agentrl.sandbox`` never imports the docker SDK.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ExecResult": "agentrl.sandbox.result",
    "SandboxLimits": "agentrl.sandbox.limits",
    "Sandbox": "agentrl.sandbox.base",
    "SandboxError": "agentrl.sandbox.base",
    "DockerSandbox": "agentrl.sandbox.docker_sandbox",
    "BwrapSandbox": "agentrl.sandbox.bwrap_sandbox",
    "SandboxPool": "agentrl.sandbox.pool",
    "make_sandbox": "agentrl.sandbox.backend",
    "Grader": "agentrl.sandbox.grader",
    "GradeResult": "agentrl.sandbox.grader",
}

__all__ = sorted(_EXPORTS)



def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
