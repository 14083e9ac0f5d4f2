"""``agentrl`` command line: a thin dispatcher; each subcommand lives with the package that owns it.

Subcommands are imported only when invoked, so ``agentrl --help`` stays fast and a missing optional
dependency only breaks the command that needs it.
"""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("agentrl.run.cli:main", "run GRPO end to end (rollout, Megatron training, weight sync)"),
    "export": ("agentrl.run.export:main", "a run's checkpoint as a HF model dir (safetensors, config, tokenizer)"),
    "rollout": ("agentrl.rollout.commands:rollout_main", "rollout only: run episodes and save Samples as JSONL"),
    "eval": ("agentrl.rollout.commands:eval_main", "held-out accuracy of a model directory on an environment"),
    "serve": ("agentrl.rollout.serve:main", "embedded engines behind the smg router in one command"),
    "gateway": ("agentrl.rollout.gateway:main", "OpenAI-compatible /v1/chat/completions that records trajectories"),
    "sandbox": ("agentrl.sandbox.cli:main", "sandbox setup (dockerd + base image) and gc of orphaned containers"),
    "check-logprobs": ("agentrl.run.check_logprobs:main", "engine vs Megatron log-prob agreement on sampled turns"),
    "check-weight-sync": ("agentrl.run.check_weight_sync:main", "bitwise check of one weight-sync mode"),
    "make-tiny-model": ("agentrl.models.tiny:main", "write a tiny random-init Qwen2 (or --arch qwen3_moe) model + test tokenizer"),
    "dump": ("agentrl.trajectory.dump:main", "print samples aligned with loss mask and provenance"),
    "view": ("agentrl.view.cli:main", "a run's samples token by token, curves and checkpoints, in the browser"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: agentrl COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"agentrl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
