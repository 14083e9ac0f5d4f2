"""Acceptance in a real headless browser (Playwright driving Debian's chromium): the served page and the
exported file show provenance classes, filter the list and draw the curves."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from agentrl.trajectory import DRIFT_CUT
from agentrl.trajectory.dump import load_decoder
from agentrl.view.app import create_app
from agentrl.view.export import export_html
from agentrl.view.run_dir import RunDir
from agentrl.view.tokens import cached_decoder

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"no chromium at {CHROMIUM} (scripts/test installs it)")


@contextlib.contextmanager
def serving(app):
    """``app`` on a free loopback port in a thread; yields its URL once it accepts requests."""
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the viewer's server did not start in 30 s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(run_dir):
    with serving(create_app(RunDir(run_dir), cached_decoder(load_decoder(str(run_dir / "hf" / "final"))))) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


def _check_page(page, shots: Path, name: str) -> None:
    from playwright.sync_api import expect  # the page's CSP forbids eval, so no wait_for_function

    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    # The curves: both series drawn from metrics.jsonl.
    assert page.locator("#curve svg polyline[data-key='rollout/reward_mean']").count() == 1
    points = page.locator("#curve svg polyline[data-key='eval_accuracy']").get_attribute("points")
    assert len(points.split()) == 3  # steps 0, 1, 2
    # A filter narrows the list: the drift outcome "cut" keeps the one truncate-policy sample of 3.
    rows = page.locator("#samples tbody tr")
    expect(rows).to_have_count(3)
    page.select_option("#filters select[name='outcome']", DRIFT_CUT)
    expect(rows).to_have_count(1)
    page.select_option("#filters select[name='outcome']", "")
    expect(rows).to_have_count(3)
    page.fill("#filters input[name='q']", "no sample says this")
    expect(rows).to_have_count(0)
    page.fill("#filters input[name='q']", "")
    expect(rows).to_have_count(3)
    # An episode: trained model tokens and tool-result (context) tokens, told apart by class and colour.
    rows.nth(0).click()
    trained = page.locator("#detail .tok[data-provenance='trained']").first
    context = page.locator("#detail .tok[data-provenance='context']").first
    trained.wait_for(timeout=10_000)
    colour = "e => getComputedStyle(e).backgroundColor"
    assert trained.evaluate(colour) != context.evaluate(colour)
    tool_text = "".join(page.locator("#detail .tok[data-provenance='context']").all_inner_texts())
    assert "<tool_response>" in tool_text and "85" in tool_text  # the calculator's result is context
    trained.hover()
    assert "rollout log-prob" in page.locator("#hover").inner_text()
    # Side by side: the same task at step 1.
    page.select_option("#compare-step", "1")
    page.click("#compare")
    page.locator("#other .tok[data-provenance='trained']").first.wait_for(timeout=10_000)
    assert "same task" in page.locator("#other h3").inner_text()
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    assert not dialogs


def test_the_served_page(browser, served, tmp_path) -> None:
    page = browser.new_page()
    page.goto(served)
    _check_page(page, tmp_path, "served")
    assert (tmp_path / "served.png").stat().st_size > 0


def test_the_exported_file_works_alone(browser, run_dir, tmp_path) -> None:
    out = tmp_path / "report.html"
    export_html(RunDir(run_dir), cached_decoder(load_decoder(str(run_dir / "hf" / "final"))), out)
    page = browser.new_page()
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(out.as_uri())
    _check_page(page, tmp_path, "exported")
    assert requests == [out.as_uri()]  # nothing fetched: the file holds everything


def test_a_truncated_step_shows_its_error_and_its_good_samples(browser, run_dir, tmp_path) -> None:
    (tmp_path / "samples").mkdir()
    line = (run_dir / "samples" / "step-1.jsonl").read_text().splitlines()[0]
    (tmp_path / "samples" / "step-1.jsonl").write_text(line + "\n" + line[:200])
    with serving(create_app(RunDir(tmp_path), cached_decoder(None))) as url:
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("body[data-ready='1']", timeout=20_000)
        assert "step-1.jsonl:2: cut short" in page.locator("#errors").inner_text()
        assert page.locator("#samples tbody tr").count() == 1
        assert "no reward or held-out rows" in page.locator("#curve").inner_text()
