"""The viewer's API on a run written the way a run writes one, and on hostile input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agentrl.trajectory import CONTEXT, DRIFT_CUT, PROMPT, REALIGNED, REALIGNED_PROMPT
from agentrl.trajectory.dump import load_decoder
from agentrl.view.app import create_app
from agentrl.view.filters import MAX_PAGE
from agentrl.view.run_dir import RunDir, RunDirError
from agentrl.view.tokens import TRAINED, UNTRAINED, cached_decoder


def client_for(root: Path, decode=None, **kw) -> TestClient:
    run = RunDir(root)
    return TestClient(create_app(run, cached_decoder(decode), **kw), base_url="http://127.0.0.1")


@pytest.fixture(scope="module")
def client(run_dir) -> TestClient:
    return client_for(run_dir, load_decoder(str(run_dir / "hf" / "final")))


def provenances(html: str) -> list[str]:
    return re.findall(r'data-provenance="([^"]+)"', html)


def test_the_run_lists_steps_checkpoints_and_the_trajectory_names(run_dir) -> None:
    client = client_for(run_dir)
    run = client.get("/api/run").json()
    assert [s["step"] for s in run["steps"]] == [1, 2] and all(s["samples"] is None for s in run["steps"])  # lazy
    assert client.get("/api/steps/2/samples").json()["total"] == 3
    assert [s["samples"] for s in client.get("/api/run").json()["steps"]] == [None, 3]  # read once shown
    assert run["checkpoints"] == {"steps": [0, 2], "latest": "step-2"}
    assert set(run["classes"]) == {TRAINED, UNTRAINED, PROMPT, CONTEXT, REALIGNED_PROMPT}
    assert DRIFT_CUT in run["outcomes"] and "truncated" in run["statuses"] and "no_tool_call" in run["stop_reasons"]
    rows = client.get("/api/metrics").json()["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["rollout/reward_mean"] == pytest.approx(0.6)


def test_a_sample_renders_each_token_with_its_provenance(client, run_dir) -> None:
    stored = [json.loads(line) for line in (run_dir / "samples" / "step-1.jsonl").read_text().splitlines()]
    for index, row in enumerate(stored):
        got = client.get(f"/api/steps/1/samples/{index}").json()
        classes = provenances(got["html"])
        assert len(classes) == len(row["tokens"])  # one span per token
        rs = row["response_start"]
        assert classes.count(TRAINED) == sum(row["loss_mask"])
        expected = [run[2] for run in row["provenance"] for _ in range(run[1] - run[0])]
        for i, (cls, source) in enumerate(zip(classes, expected, strict=True)):
            if source == "model":
                assert cls == (TRAINED if row["loss_mask"][i - rs] else UNTRAINED)
            else:
                assert cls == source
        assert got["html"].count('class="drift"') == len(row["metadata"]["drift_points"])
    drifted = client.get("/api/steps/1/samples/2").json()
    assert f'data-drift="{DRIFT_CUT}"' in drifted["html"] and UNTRAINED in provenances(drifted["html"])
    assert "calculator" in drifted["html"]  # token text from the run's own tokenizer


def test_filters_narrow_the_list(client) -> None:
    def indexes(**params) -> list[int]:
        return [s["index"] for s in client.get("/api/steps/1/samples", params=params).json()["items"]]

    assert indexes() == [0, 1, 2]
    assert indexes(outcome=DRIFT_CUT) == [2] and indexes(outcome=REALIGNED) == [1]
    assert indexes(reward_min=0.75) == [0, 1] and indexes(reward_max=0.75) == [2]  # rewards 1, 1, 0.5
    assert indexes(q="CORRECT") == [0, 1, 2] and indexes(q="no such text") == []
    assert indexes(stop_reason="no_tool_call") == [0, 1, 2] and indexes(status="aborted") == []
    task = client.get("/api/steps/1/samples").json()["items"][0]["task"]
    same = client.get("/api/steps/2/samples", params={"task": task}).json()["items"]
    assert same and all(s["task"] == task for s in same)  # the side-by-side finds step 2's sample


def _synthetic_step(path: Path, n: int) -> None:
    row = {"tokens": [1, 2, 3, 4], "response_start": 2, "loss_mask": [1, 1], "rollout_logprobs": [-0.5, -0.25],
           "provenance": [[0, 2, "prompt", 0, None], [2, 4, "model", 0, "3"]], "status": "completed"}
    path.write_text("".join(json.dumps({**row, "reward": i % 2, "session_id": f"s{i}"}) + "\n" for i in range(n)))


def test_a_step_of_10k_samples_is_served_in_bounded_pages(tmp_path) -> None:
    (tmp_path / "samples").mkdir()
    _synthetic_step(tmp_path / "samples" / "step-5.jsonl", 10_000)
    client = client_for(tmp_path)
    page = client.get("/api/steps/5/samples", params={"offset": 9_900, "limit": MAX_PAGE}).json()
    assert page["total"] == 10_000 and [s["index"] for s in page["items"]] == list(range(9_900, 10_000))
    assert client.get("/api/steps/5/samples", params={"reward_min": 1}).json()["total"] == 5_000
    assert len(client.get("/api/steps/5/samples", params={"limit": MAX_PAGE}).json()["items"]) == MAX_PAGE
    assert client.get("/api/steps/5/samples", params={"limit": MAX_PAGE + 1}).status_code == 422
    assert client.get("/api/steps/5/samples", params={"limit": 10**12}).status_code == 422
    assert client.get("/api/steps/5/samples", params={"offset": -1}).status_code == 422
    assert client.get("/api/steps/5/samples", params={"q": "x" * 201}).status_code == 422  # bounded search
    assert client.get("/api/steps/5/samples/9999").json()["summary"]["session_id"] == "s9999"


@pytest.mark.parametrize("url", ["/api/steps/..%2F..%2Fetc%2Fpasswd/samples", "/api/steps/1.jsonl/samples",
                                 "/api/steps/1/samples/..%2F..%2Fmetrics", "/api/steps/-1/samples",
                                 "/api/steps/1/samples/3", "/api/steps/1/samples/-1", "/static/../../etc/passwd",
                                 "/../../../etc/passwd", "/api/steps/99/samples"])
def test_no_request_reads_beyond_the_run_s_step_files(client, url) -> None:
    got = client.get(url)
    assert got.status_code in (404, 422) and "root:" not in got.text


def test_a_foreign_host_header_is_refused(client) -> None:
    assert client.get("/api/run", headers={"host": "attacker.example"}).status_code == 400
    assert client.get("/api/run").status_code == 200


def test_token_text_and_chat_are_escaped(run_dir, tmp_path) -> None:
    hostile = '<script>alert(1)</script><img src=x onerror=alert(2)>"'
    rows = [json.loads(line) for line in (run_dir / "samples" / "step-1.jsonl").read_text().splitlines()]
    rows[0]["metadata"]["messages"][1]["content"] = hostile
    rows[0]["metadata"]["drift_points"] = [{"turn": 1, "position": 3, "outcome": hostile}]
    rows[0]["session_id"] = hostile
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step-1.jsonl").write_text(json.dumps(rows[0]) + "\n")
    client = client_for(tmp_path, decode=lambda token: hostile)
    html = client.get("/api/steps/1/samples/0").json()["html"]
    assert "<script" not in html and "<img" not in html and "&lt;script&gt;" in html
    assert client.get("/api/steps/1/samples", params={"q": "<script>"}).json()["total"] == 1
    page = client.get("/").text
    assert page.count("<script") == 2  # the JSON island and the app: nothing else runs


def test_bad_lines_are_skipped_and_named(tmp_path, run_dir) -> None:
    (tmp_path / "samples").mkdir()
    good = (run_dir / "samples" / "step-1.jsonl").read_text().splitlines()
    (tmp_path / "samples" / "step-1.jsonl").write_text(
        good[0] + "\n" + '{"tokens": [1]}\n' + good[1] + "\n" + good[2][: len(good[2]) // 2])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "eval_accuracy": 0.5}\nnot json\n[1, 2]\n')
    client = client_for(tmp_path)
    errors = client.get("/api/steps/1/samples").json()["errors"]
    assert client.get("/api/run").json()["steps"][0]["errors"] == errors
    assert len(errors) == 2 and errors[0].startswith("step-1.jsonl:2: not a sample")
    assert errors[1].startswith("step-1.jsonl:4: cut short")
    assert client.get("/api/steps/1/samples").json()["total"] == 2  # the good lines are all there
    metrics = client.get("/api/metrics").json()
    assert metrics["rows"] == [{"step": 1, "eval_accuracy": 0.5}]
    assert metrics["errors"] == ["metrics.jsonl:2: not JSON (Expecting value)", "metrics.jsonl:3: not a JSON object"]


def test_a_path_that_is_no_run_is_refused(tmp_path) -> None:
    with pytest.raises(RunDirError, match="no such run directory"):
        RunDir(tmp_path / "missing")
    with pytest.raises(RunDirError, match="not a run directory"):
        RunDir(tmp_path)


def test_hover_facts_carry_logprobs_and_weights_and_trainer_logprobs_when_stored(run_dir, tmp_path) -> None:
    row = json.loads((run_dir / "samples" / "step-1.jsonl").read_text().splitlines()[0])
    n_resp = len(row["tokens"]) - row["response_start"]
    row["metadata"]["trainer_logprobs"] = [-0.125] * n_resp
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step-1.jsonl").write_text(json.dumps(row) + "\n")
    html = client_for(tmp_path).get("/api/steps/1/samples/0").json()["html"]
    trained = re.findall(r'<span class="tok" data-provenance="trained"[^>]*>', html)
    assert len(trained) == sum(row["loss_mask"])
    first = row["provenance"][1]  # the first model run: its first token's rollout log-prob and weights
    lp = row["rollout_logprobs"][first[0] - row["response_start"]]
    assert f'data-lp="{lp:.6g}"' in trained[0] and 'data-tlp="-0.125"' in trained[0]
    assert f'data-wv="{first[4]}"' in trained[0] and "trainer log-prob -0.1250" in trained[0]
    row["metadata"]["trainer_logprobs"] = [-0.125]  # not one per response token: not shown, not guessed
    (tmp_path / "samples" / "step-1.jsonl").write_text(json.dumps(row) + "\n")
    assert "data-tlp" not in client_for(tmp_path).get("/api/steps/1/samples/0").json()["html"]
