"""Sandboxes for model-written code: Docker containers (or bubblewrap) with hard limits, a pre-warmed
pool, and a grader that runs hidden tests in a fresh sandbox.

    from agentrl.sandbox import DockerSandbox, SandboxPool, Grader

    with DockerSandbox() as sb:                       # needs `agentrl sandbox setup` once
        sb.write_files({"main.py": "print(input())"})
        r = sb.exec("python3 main.py", timeout=5, stdin="hi")   # ExecResult(exit_code=0, stdout='hi\n', ...)
        r = sb.run_python("print(2 + 2)", timeout=5)

    with SandboxPool(size=8) as pool:                 # backend="auto": docker, else bubblewrap
        async with pool.asession() as sb:             # (inside the agent loop)
            r = await sb.aexec("python3 main.py", timeout=30)

    Grader().grade({"solution.py": code}, {"test_solution.py": hidden_tests}).passed

How a command runs: each sandbox starts one small executor (``executor.py``, stdlib only) inside it
as uid 1000 and talks to it over one ``docker exec`` stream; commands are forked by the executor,
each in its own session, killed with its whole process group at exit or timeout, output capped per
stream. ``run_python`` forks the executor's interpreter instead of starting ``python3`` (about 7 ms
of CPU per call instead of ~20). The container's keep-alive runs as uid 65534, out of the agent's reach.

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
    "PooledGrader": "agentrl.sandbox.pooled_grader",
}

__all__ = sorted(_EXPORTS)



def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.sandbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
