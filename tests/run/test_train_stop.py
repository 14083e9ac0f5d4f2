"""`agentrl train` stopped by SIGTERM mid-run leaves no engine, router, Ray worker or shared-memory weight
copy behind; its logs are under the output dir."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.timeout(600)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_sigterm_mid_run_stops_every_process_and_leaves_no_shm(tmp_path) -> None:
    out = tmp_path / "run"
    shm_before = set(Path("/dev/shm").glob("agentrl-weights-*"))
    cmd = [sys.executable, "-m", "agentrl.cli", "train", "examples/arithmetic/config.yaml", "--output-dir", str(out),
           "--cache_dir", str(tmp_path / "cache"), "--steps", "50", "--warmup.max_steps", "2",
           "--warmup.check_every", "2", "--warmup.num_conversations", "16", "--rollout.num_engines", "1",
           "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2", "--rollout.max_new_tokens", "8",
           "--eval.num_tasks", "4", "--sync_mode", "disk"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:  # wait until GRPO steps run (engines, router, trainer all up)
            for p in _descendants(proc.pid):
                with contextlib.suppress(psutil.Error):
                    seen[p.pid] = " ".join(p.cmdline())[:120]
            metrics = out / "metrics.jsonl"
            if metrics.exists() and any(json.loads(r).get("step", 0) >= 1 for r in metrics.read_text().splitlines()):
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("the run never reached GRPO step 1")
        assert any("agentrl.engine" in c for c in seen.values()) and any("smg" in c for c in seen.values())
        os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    time.sleep(2)
    alive = [f"{pid}: {cmd}" for pid, cmd in seen.items() if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"left running after SIGTERM: {alive}"
    assert set(Path("/dev/shm").glob("agentrl-weights-*")) <= shm_before
    assert f"process logs in {out / 'logs'}" in output
    assert list((out / "logs").glob("engine-*.log")) and list((out / "logs").glob("router-*.log"))
