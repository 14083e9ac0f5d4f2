"""/generate: SGLang response shape, sampling controls, stop conditions, batch input, streaming."""

from __future__ import annotations

import json

import pytest

PROMPT = [1, 20, 30, 40, 50]


def gen(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_response_shape_like_sglang(client):
    out = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0}, return_logprob=True)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert isinstance(meta["cached_tokens"], int)
    assert meta["weight_version"] == "default"
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert all(lp <= 0 and none is None for lp, _, none in lps)
    assert isinstance(meta["id"], str) and meta["id"]


def test_logprobs_omitted_unless_asked(client):
    out = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    assert "output_token_logprobs" not in out["meta_info"]


def test_text_input_is_tokenized(client, server):
    out = gen(client, text="What is 12+34?", sampling_params={"max_new_tokens": 3, "temperature": 0})
    expected = len(server.engine.runner.tokenizer("What is 12+34?").input_ids)
    assert out["meta_info"]["prompt_tokens"] == expected
    assert out["text"] == server.engine.runner.tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_greedy_is_deterministic_and_top_k_1_is_greedy(client):
    a = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0})
    b = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0.7, "top_k": 1})
    assert a["output_ids"] == b["output_ids"]


def test_seeded_sampling_is_reproducible(client):
    sp = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 1234}
    a = gen(client, input_ids=PROMPT, sampling_params=sp)
    b = gen(client, input_ids=PROMPT, sampling_params=sp)
    c = gen(client, input_ids=PROMPT, sampling_params={**sp, "sampling_seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]  # 12 draws over a near-uniform vocab of 1024


def test_top_p_tiny_keeps_only_the_argmax(client):
    greedy = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0})
    nucleus = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 1.0, "top_p": 1e-6})
    assert nucleus["output_ids"] == greedy["output_ids"]


def test_stop_token_ids_end_generation_and_are_returned(client):
    greedy = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0})
    stop_tok = greedy["output_ids"][2]
    first = greedy["output_ids"].index(stop_tok)
    out = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_tok]})
    assert out["output_ids"] == greedy["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}


def test_eos_stops_unless_ignore_eos(client, server):
    eos = server.engine.runner.tokenizer.eos_token_id
    # force eos by a prompt whose greedy continuation we do not know: use stop via eos in stop_token_ids
    # semantics instead -- sample with top_k over a vocab where eos is likely is not controllable, so we
    # check the rule directly on the scheduler's stop test
    from agentrl.engine.protocol import SamplingParams
    from agentrl.engine.scheduler import Sequence

    sched = server.engine.scheduler
    seq = Sequence(prompt_ids=[1], params=SamplingParams(max_new_tokens=5))
    seq.output_ids = [eos]
    assert sched._finish_reason_after(seq, eos) == {"type": "stop", "matched": eos}
    seq2 = Sequence(prompt_ids=[1], params=SamplingParams(max_new_tokens=5, ignore_eos=True))
    seq2.output_ids = [eos]
    assert sched._finish_reason_after(seq2, eos) is None


def test_stop_string_truncates_text(client, server):
    tok = server.engine.runner.tokenizer
    greedy = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 10, "temperature": 0})
    full = tok.decode(greedy["output_ids"], skip_special_tokens=True)
    stop = full[3:5]
    assert stop and stop in full
    out = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 10, "temperature": 0, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]
    assert greedy["output_ids"][: len(out["output_ids"])] == out["output_ids"]
    kept = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 10, "temperature": 0, "stop": stop, "no_stop_trim": True})
    assert stop in kept["text"]


def test_batch_input_returns_a_list_in_order(client):
    prompts = [[1, 2, 3], [1, 9], [4, 5, 6, 7, 8]]
    outs = gen(client, input_ids=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs, strict=True):
        single = gen(client, input_ids=p, sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert o["meta_info"]["prompt_tokens"] == len(p)
        assert o["output_ids"] == single["output_ids"]


def test_n_samples(client):
    outs = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 5, "n": 3}, rid="multi")
    assert len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["multi-0", "multi-1", "multi-2"]


def test_max_new_tokens_is_clamped_to_the_context(client, server):
    ctx = server.engine.runner.context_length
    prompt = [5] * (ctx - 3)
    out = gen(client, input_ids=prompt, sampling_params={"max_new_tokens": 50, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_stream_sends_cumulative_chunks_then_done(client):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "return_logprob": True, "stream": True}
    chunks, done = [], False
    with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
    assert done
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["output_ids"]) == 5 == len(final["meta_info"]["output_token_logprobs"])
    greedy = gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 5, "temperature": 0})
    assert final["output_ids"] == greedy["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("endpoint", ["/health", "/health_generate"])
def test_health(client, endpoint):
    assert client.get(endpoint).status_code == 200


def test_model_and_server_info_report_local_path(client, tiny_model):
    info = client.get("/model_info").json()
    assert info["model_path"] == str(tiny_model) and info["tokenizer_path"] == str(tiny_model)
    assert info["is_generation"] is True
    sinfo = client.get("/server_info").json()
    assert sinfo["model_path"] == str(tiny_model)
    assert sinfo["weight_version"] == client.get("/get_weight_version").json()["weight_version"]
    assert sinfo["context_length"] == 512


def test_get_load_and_metrics(client):
    gen(client, input_ids=PROMPT, sampling_params={"max_new_tokens": 2})
    load = client.get("/get_load").json()
    assert load[0]["num_reqs"] == 0 and "num_waiting_reqs" in load[0]
    text = client.get("/metrics").text
    for name in ("agentrl_engine_requests_total", "agentrl_engine_generation_tokens_total",
                 "agentrl_engine_cached_tokens_total", "agentrl_engine_batch_size_bucket"):
        assert name in text
    requests = [ln for ln in text.splitlines() if ln.startswith("agentrl_engine_requests_total")]
    assert float(requests[0].split()[-1]) >= 1
