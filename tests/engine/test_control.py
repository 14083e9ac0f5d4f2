"""Pause / continue / abort semantics (SGLang's): in-flight requests end with finish_reason "abort" in
abort mode, freeze in place, or go back to the queue (retract); new requests wait while paused."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

LONG = {"max_new_tokens": 400, "ignore_eos": True}
PROMPT = [1, 7, 8, 9]


class Background:
    """POST /generate in a thread; ``.result`` once done."""

    def __init__(self, url: str, body: dict) -> None:
        self.result: dict | None = None
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        r = httpx.post(url + "/generate", json=body, timeout=120)
        self.status, self.result = r.status_code, r.json()

    def join(self, timeout: float = 60) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "request did not finish"
        assert self.status == 200
        return self.result


def wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def load(client) -> dict:
    return client.get("/get_load").json()[0]


def running_tokens(client) -> int:
    return load(client)["num_tokens"]


@pytest.fixture(autouse=True)
def _always_continue(client):
    yield
    client.post("/continue_generation", json={})


def test_pause_abort_returns_partial_outputs_and_queues_new_requests(client, server):
    bg = Background(server.url, {"input_ids": PROMPT, "sampling_params": LONG, "return_logprob": True})
    wait_until(lambda: load(client)["num_running_reqs"] == 1 and running_tokens(client) > len(PROMPT) + 2)
    r = client.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200 and r.json()["success"]
    out = bg.join()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 400
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(out["output_ids"])
    # while paused, a new request waits ...
    waiting = Background(server.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    wait_until(lambda: load(client)["num_waiting_reqs"] == 1)
    time.sleep(0.2)
    assert waiting.thread.is_alive()
    assert client.get("/health").status_code == 200  # and the server still answers
    # ... and runs after continue
    assert client.post("/continue_generation", json={}).json()["success"]
    assert waiting.join()["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_in_place_freezes_and_continue_finishes(client, server, hf_model, hf_logprobs):
    bg = Background(server.url, {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 120}, "return_logprob": True})
    wait_until(lambda: load(client)["num_running_reqs"] == 1)
    client.post("/pause_generation", json={"mode": "in_place"})
    frozen = running_tokens(client)
    time.sleep(0.3)
    assert running_tokens(client) == frozen and load(client)["num_running_reqs"] == 1
    client.post("/continue_generation", json={})
    out = bg.join()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 120
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(hf_model, PROMPT, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-5


def test_pause_retract_requeues_and_recomputes(client, server, hf_model, hf_logprobs):
    bg = Background(server.url, {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 200}, "return_logprob": True})
    wait_until(lambda: load(client)["num_running_reqs"] == 1 and running_tokens(client) > len(PROMPT) + 2)
    client.post("/pause_generation", json={"mode": "retract"})
    state = load(client)
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 1 and state["num_tokens"] == 0
    client.post("/continue_generation", json={})
    out = bg.join()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 200
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    ref = hf_logprobs(hf_model, PROMPT, out["output_ids"])
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-5


def test_abort_request_by_rid_and_all(client, server):
    a = Background(server.url, {"input_ids": PROMPT, "sampling_params": LONG, "rid": "victim"})
    b = Background(server.url, {"input_ids": [1, 5], "sampling_params": {**LONG, "max_new_tokens": 60}, "rid": "bystander"})
    wait_until(lambda: load(client)["num_running_reqs"] == 2)
    assert client.post("/abort_request", json={"rid": "victim"}).json()["num_aborted"] == 1
    out_a = a.join()
    assert out_a["meta_info"]["id"] == "victim"
    assert out_a["meta_info"]["finish_reason"]["type"] == "abort"
    assert b.join()["meta_info"]["finish_reason"]["type"] == "length"
    c = Background(server.url, {"input_ids": PROMPT, "sampling_params": LONG})
    d = Background(server.url, {"input_ids": PROMPT, "sampling_params": LONG})
    wait_until(lambda: load(client)["num_reqs"] == 2)
    assert client.post("/abort_request", json={"abort_all": True}).json()["num_aborted"] == 2
    assert c.join()["meta_info"]["finish_reason"]["type"] == "abort"
    assert d.join()["meta_info"]["finish_reason"]["type"] == "abort"


def test_stream_disconnect_aborts_the_request(client, server):
    body = {"input_ids": PROMPT, "sampling_params": LONG, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk received, then hang up
    wait_until(lambda: load(client)["num_reqs"] == 0, timeout=10)


def test_update_weight_version(client):
    r = client.post("/update_weight_version", json={"new_version": "v-manual"})
    assert r.status_code == 200 and r.json()["success"]
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["weight_version"] == "v-manual"
    assert client.get("/get_weight_version").json()["weight_version"] == "v-manual"


def test_health_generate_answers_while_paused(client):
    client.post("/pause_generation", json={"mode": "in_place"})
    assert client.get("/health_generate", timeout=5).status_code == 200


def test_client_disconnect_aborts_a_non_streaming_request(client, server):
    # Frozen in place before the hang-up, so the request cannot finish first however fast the machine is.
    finished = server.engine.metrics.finished_requests
    aborts, lengths = finished.labels(reason="abort")._value.get(), finished.labels(reason="length")._value.get()
    body = json.dumps({"input_ids": PROMPT, "sampling_params": LONG}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_until(lambda: load(client)["num_running_reqs"] == 1)
    client.post("/pause_generation", json={"mode": "in_place"})
    assert load(client)["num_running_reqs"] == 1, "the request finished before it could be frozen"
    conn.close()
    wait_until(lambda: load(client)["num_reqs"] == 0, timeout=10)
    assert finished.labels(reason="abort")._value.get() == aborts + 1
    assert finished.labels(reason="length")._value.get() == lengths


def test_a_failing_step_aborts_in_flight_requests_and_the_engine_keeps_serving(client, server, monkeypatch):
    decoder = server.engine.scheduler.decoder  # the runner, or on the CPU the lean decoder
    real_decode = decoder.decode
    calls = {"n": 0}

    def flaky_decode(batch, tokens):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real_decode(batch, tokens)

    monkeypatch.setattr(decoder, "decode", flaky_decode)
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10}}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "simulated kernel failure" in out["meta_info"]["finish_reason"]["message"]
    out = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10}}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
