"""A new built-in transport is one file plus its registry line: trains a step through ``agentrl train``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_transport_added_in_one_file_and_one_registry_line_trains_a_step(tmp_path, monkeypatch) -> None:
    from agentrl.run.cli import main
    from agentrl.weights import transport as registry

    here = str(Path(__file__).parent)  # the Ray workers import the new module as the driver does
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.syspath_prepend(here)
    monkeypatch.setitem(registry.TRANSPORTS, "body", "body_transport:BodyTransport")
    record, out = tmp_path / "sent.txt", tmp_path / "run"
    code = main(["examples/arithmetic/config.yaml", "--output-dir", str(out), "--cache_dir", str(tmp_path / "cache"),
                 "--steps", "1", "--expert", "null", "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2",
                 "--rollout.samples_per_prompt", "2", "--rollout.max_new_tokens", "8", "--eval.num_tasks", "2",
                 "--sync_mode", "full", "--sync_options", json.dumps({"transport": "body", "record": str(record)})])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1)
    assert step["sync/bytes_sent"] > step["sync/full_bytes"] > 0  # the whole model in one body, with its header
    assert record.read_text().split()[-1] == "1"  # step 1's weights went over the new transport, with its own option
