"""``agentrl view`` on the command line: export, bad input as one clear line, loopback by default."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from html.parser import HTMLParser

import pytest

from agentrl.cli import main as agentrl
from agentrl.engine.launch import is_loopback
from agentrl.view.tokens import PROVENANCE_CLASSES


class Tokens(HTMLParser):
    """Every ``data-provenance`` value in a file and every external reference (src/href) it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.provenance: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        attrs = dict(attrs)
        if "data-provenance" in attrs and "tok" in (attrs.get("class") or "").split():
            self.provenance.append(attrs["data-provenance"])
        self.external += [attrs[k] for k in ("src", "href") if attrs.get(k)]


def test_export_writes_one_self_contained_file(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "report.html"
    assert agentrl(["view", str(run_dir), "--export", str(out)]) == 0
    assert "6 samples of 2 steps" in capsys.readouterr().out
    parsed = Tokens()
    parsed.feed(out.read_text())
    rows = [json.loads(line) for step in (1, 2) for line in (run_dir / "samples" / f"step-{step}.jsonl").open()]
    assert len(parsed.provenance) == sum(len(r["tokens"]) for r in rows)
    assert set(parsed.provenance) == set(PROVENANCE_CLASSES)  # every class: trained, untrained, prompt, context, ...
    assert parsed.external == []  # no CDN, no asset beside the file
    assert agentrl(["view", str(run_dir), "--export", str(out), "--max-samples", "1"]) == 0
    fewer = Tokens()
    fewer.feed(out.read_text())
    assert 0 < len(fewer.provenance) < len(parsed.provenance)


@pytest.mark.parametrize("case", ["missing", "empty", "truncated", "metrics"])
def test_bad_input_is_one_clear_line(run_dir, tmp_path, case) -> None:
    root = tmp_path / "run"
    if case != "missing":
        (root / "samples").mkdir(parents=True)
    if case == "truncated":
        line = (run_dir / "samples" / "step-1.jsonl").read_text().splitlines()[0]
        (root / "samples" / "step-1.jsonl").write_text(line + "\n" + line[:100])
    if case == "metrics":
        (root / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "eval_acc\n')
    if case == "empty":
        root = tmp_path  # holds no samples/, metrics.jsonl or checkpoints/
    got = subprocess.run([sys.executable, "-m", "agentrl.cli", "view", str(root), "--export", str(tmp_path / "o.html")],
                         capture_output=True, text=True, timeout=120)
    assert "Traceback" not in got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("agentrl view: ")
    expected = {"missing": (2, "no such run directory"), "empty": (2, "not a run directory"),
                "truncated": (0, "skipped step-1.jsonl:2: cut short"), "metrics": (0, "skipped metrics.jsonl:2: not JSON")}
    code, message = expected[case]
    assert got.returncode == code and message in lines[0]


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.1", "::", "example.com"])
def test_a_non_loopback_address_is_refused_by_default(run_dir, host, capsys) -> None:
    assert agentrl(["view", str(run_dir), "--host", host]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_loopback_names() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("localhost.example.com")


def test_serve_binds_loopback_and_answers(run_dir) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.cli", "view", str(run_dir), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        deadline = time.monotonic() + 30
        while True:
            try:
                body = json.load(urllib.request.urlopen(url + "api/run", timeout=5))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert [s["step"] for s in body["steps"]] == [1, 2]
        assert "dataset.ready" in urllib.request.urlopen(url, timeout=5).read().decode()  # the page and its script
    finally:
        proc.terminate()
        proc.wait(timeout=20)
