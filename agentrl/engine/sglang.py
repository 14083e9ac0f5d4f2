"""Launch real SGLang (``python -m sglang.launch_server``) from agentrl's config on GPU clusters.

agentrl owns ``--model-path``, ``--host``, ``--port`` (and sets dtype, TP size, memory fraction, memory
saver and weight version from its config); every other SGLang server flag is given on agentrl's command
line with an ``--sglang-`` prefix and passed through untouched: ``--sglang-mem-fraction-static 0.7``
becomes ``--mem-fraction-static 0.7``.

For ``--help`` and validation, :func:`add_sglang_arguments` uses slime's trick: it calls SGLang's own
``ServerArgs.add_cli_args`` on our parser through a wrapper that prefixes every flag with ``sglang-``, so
every flag of the installed SGLang version is known. Without SGLang (CPU machines, CI) a static list of
common flags is registered instead, and unknown ``--sglang-*`` flags are still passed through.

:class:`SGLangProcess` has the same API as :class:`~agentrl.engine.launch.EngineProcess`. It cannot run
here (SGLang needs CUDA); the argument translation is unit-tested.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.engine.launch import EngineProcess

PREFIX = "--sglang-"
# flags agentrl sets itself; passing them as --sglang-* would be ambiguous
OWNED = frozenset({"model-path", "model", "host", "port"})

# (flag, argparse kwargs) of common SGLang 0.5.x server flags, used when sglang is not importable
FALLBACK_FLAGS: list[tuple[str, dict]] = [
    ("tp-size", {"type": int}),
    ("dp-size", {"type": int}),
    ("pp-size", {"type": int}),
    ("ep-size", {"type": int}),
    ("mem-fraction-static", {"type": float}),
    ("context-length", {"type": int}),
    ("max-running-requests", {"type": int}),
    ("max-total-tokens", {"type": int}),
    ("chunked-prefill-size", {"type": int}),
    ("max-prefill-tokens", {"type": int}),
    ("schedule-policy", {"type": str}),
    ("attention-backend", {"type": str}),
    ("sampling-backend", {"type": str}),
    ("dtype", {"type": str}),
    ("kv-cache-dtype", {"type": str}),
    ("quantization", {"type": str}),
    ("load-format", {"type": str}),
    ("tokenizer-path", {"type": str}),
    ("served-model-name", {"type": str}),
    ("random-seed", {"type": int}),
    ("base-gpu-id", {"type": int}),
    ("cuda-graph-max-bs", {"type": int}),
    ("cuda-graph-bs", {"type": int, "nargs": "+"}),
    ("log-level", {"type": str}),
    ("weight-version", {"type": str}),
    ("trust-remote-code", {"action": "store_true"}),
    ("enable-memory-saver", {"action": "store_true"}),
    ("disable-radix-cache", {"action": "store_true"}),
    ("disable-cuda-graph", {"action": "store_true"}),
    ("skip-server-warmup", {"action": "store_true"}),
    ("enable-deterministic-inference", {"action": "store_true"}),
    ("enable-metrics", {"action": "store_true"}),
    ("skip-tokenizer-init", {"action": "store_true"}),
]


def _sglang_server_args():
    try:
        from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found]
    except Exception:  # not installed, or installed without its CUDA deps
        return None
    return ServerArgs


def add_sglang_arguments(parser: argparse.ArgumentParser) -> bool:
    """Register every SGLang server flag as ``--sglang-<flag>`` (dest ``sglang_<dest>``) on ``parser``.

    Returns True when SGLang's own ``ServerArgs.add_cli_args`` was used, False for the static fallback.
    """
    server_args = _sglang_server_args()
    group = parser.add_argument_group("SGLang server (passed through to sglang.launch_server)")
    if server_args is None:
        for flag, kwargs in FALLBACK_FLAGS:
            group.add_argument(PREFIX + flag, dest="sglang_" + flag.replace("-", "_"), default=None, **kwargs)
        return False

    original = parser.add_argument

    def prefixed(*names: str, **kwargs):
        longs = [n for n in names if n.startswith("--")]
        if not longs or any(n[2:] in OWNED for n in longs):
            return None  # agentrl owns it (or a short-only flag we do not expose)
        kwargs.pop("required", None)
        dest = kwargs.pop("dest", longs[0][2:].replace("-", "_"))
        kwargs["dest"] = "sglang_" + dest
        return original(*(PREFIX + n[2:] for n in longs), **kwargs)

    parser.add_argument = prefixed  # type: ignore[method-assign]
    try:
        server_args.add_cli_args(parser)
    finally:
        parser.add_argument = original  # type: ignore[method-assign]
    return True


def split_sglang_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into (agentrl's own tokens, ``--sglang-*`` flags with their values, verbatim).

    A ``--sglang-*`` flag takes every following token that does not start with ``--`` (so lists and
    negative numbers stay with it); ``--sglang-x=value`` is one token. So put agentrl's positional
    arguments before the ``--sglang-*`` flags (or use the ``=`` form).
    """
    own: list[str] = []
    passthrough: list[str] = []
    taking = False
    for tok in argv:
        if tok.startswith(PREFIX):
            taking = "=" not in tok
            passthrough.append(tok)
        elif tok.startswith("--") or not taking:
            taking = False
            own.append(tok)
        else:
            passthrough.append(tok)
    return own, passthrough


def to_sglang_flags(passthrough: Sequence[str]) -> list[str]:
    """``--sglang-foo`` -> ``--foo`` (values untouched); refuses flags agentrl sets itself."""
    out = []
    for tok in passthrough:
        if tok.startswith(PREFIX):
            name = tok[len(PREFIX) :].split("=", 1)[0]
            if name in OWNED:
                raise ValueError(f"{tok}: agentrl sets --{name} itself; use agentrl's own option")
            out.append("--" + tok[len(PREFIX) :])
        else:
            out.append(tok)
    return out


@dataclass
class SGLangServerConfig:
    """The part of agentrl's config that shapes an SGLang server."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str | None = None  # "bfloat16", "float16", "auto", ...
    tp_size: int = 1
    # With CUDA_VISIBLE_DEVICES set to the GPUs Ray assigned, the engine's first GPU is always 0.
    base_gpu_id: int | None = None
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False  # needed for release/resume_memory_occupation (colocated trainer)
    weight_version: str | None = None
    api_key: str | None = None  # SGLang's own guard: every route but /health* and /metrics needs it
    passthrough: list[str] = field(default_factory=list)  # raw --sglang-* tokens


def sglang_launch_command(config: SGLangServerConfig, python: str = sys.executable) -> list[str]:
    """The full ``python -m sglang.launch_server ...`` argv (agentrl's flags first, then passthrough)."""
    passthrough = to_sglang_flags(config.passthrough)
    given = {tok.split("=", 1)[0] for tok in passthrough if tok.startswith("--")}
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(config.model_path),
           "--host", config.host, "--port", str(config.port)]

    def add(flag: str, *values: str) -> None:
        if flag not in given:  # an explicit --sglang-* flag wins over agentrl's default
            cmd.extend([flag, *values])

    if config.dtype is not None:
        add("--dtype", config.dtype)
    if config.tp_size != 1:
        add("--tp-size", str(config.tp_size))
    if config.base_gpu_id is not None:
        add("--base-gpu-id", str(config.base_gpu_id))
    if config.mem_fraction_static is not None:
        add("--mem-fraction-static", str(config.mem_fraction_static))
    if config.enable_memory_saver:
        add("--enable-memory-saver")
    if config.weight_version is not None:
        add("--weight-version", config.weight_version)
    if config.api_key is not None:
        # SGLang takes its key only as a flag (visible to local users in ps), unlike our engine
        add("--api-key", config.api_key)
    return cmd + passthrough


class SGLangProcess(EngineProcess):
    """A real SGLang server process with :class:`EngineProcess`'s API (start, wait_healthy, stop, log_path, ...).

    Like an embedded engine it dies with the process that started it; SGLang's own scheduler and detokenizer
    children die with it (SGLang's ``kill_itself_when_parent_died`` ties them the same way). ``secret``
    becomes SGLang's ``--api-key``; the router presents it to the worker (see :mod:`agentrl.rollout.router`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        dtype: str | None = None,
        tp_size: int = 1,
        base_gpu_id: int | None = None,
        mem_fraction_static: float | None = None,
        enable_memory_saver: bool = False,
        sglang_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        log_dir: str | Path | None = None,
        secret: str | None = None,
    ) -> None:
        super().__init__(model_dir, port=port, host=host, dtype=dtype or "auto", env=env, log_path=log_path,
                         log_dir=log_dir, secret=secret)
        self.config = SGLangServerConfig(
            model_path=str(model_dir), host=host, port=self.port, dtype=dtype, tp_size=tp_size,
            base_gpu_id=base_gpu_id, mem_fraction_static=mem_fraction_static, enable_memory_saver=enable_memory_saver,
            api_key=self.secret, passthrough=list(sglang_args),
        )
        to_sglang_flags(self.config.passthrough)  # fail early on owned flags

    def command(self) -> list[str]:
        return sglang_launch_command(self.config)

    def wait_healthy(self, timeout: float = 600) -> SGLangProcess:  # SGLang loads and captures CUDA graphs
        super().wait_healthy(timeout)
        return self
