"""The ``model`` argument of ``agentrl eval`` / ``agentrl rollout``: a local HF model directory, checked
before any engine starts (a missing path would otherwise reach HF as a bad "repo id")."""

from __future__ import annotations

import argparse
from pathlib import Path


def local_model_dir(value: str) -> str:
    """``value`` when it is a directory holding ``config.json``; argparse's one-line error otherwise."""
    path = Path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is not a directory (a local HF model dir is expected)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{value} has no config.json, so it is not a HF model dir")
    return value
