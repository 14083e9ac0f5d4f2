"""Bad input gets a 4xx with a message naming the problem; the engine keeps serving afterwards."""

from __future__ import annotations

import json

import pytest

OK = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}

CASES = {
    "unknown top-level field": ({**OK, "max_tokens": 5}, "max_tokens"),
    "unknown sampling field": ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 5}}, "max_tokens"),
    "unsupported sglang feature": ({**OK, "lora_path": "adapter"}, "lora_path"),
    "unsupported sampling feature": ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "regex"),
    "max_new_tokens zero": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    "max_new_tokens negative": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    "max_new_tokens not int": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
    "temperature negative": ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    "top_p zero": ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    "token id too large": ({"input_ids": [1, 1024]}, "out of vocabulary"),
    "token id negative": ({"input_ids": [1, -1]}, "out of vocabulary"),
    "token id not int": ({"input_ids": [1, "a"]}, "integers"),
    "empty input_ids": ({"input_ids": []}, "empty prompt"),
    "empty batch item": ({"input_ids": [[1, 2], []]}, "empty prompt"),
    "empty text": ({"text": ""}, "empty prompt"),
    "both text and ids": ({"text": "hi", "input_ids": [1]}, "exactly one"),
    "neither text nor ids": ({"sampling_params": {}}, "exactly one"),
    "prompt over context length": ({"input_ids": [5] * 512}, "context length"),
    "sampling_params not an object": ({"input_ids": [1], "sampling_params": [1, 2]}, "sampling_params"),
    "body not an object": ([1, 2, 3], "JSON object"),
    "stream with batch": ({"input_ids": [[1], [2]], "stream": True}, "stream"),
    # non-finite, subnormal and out-of-range numbers: a clear 400, never a 500 or garbage tokens
    **{f"{key} {label}": ({"input_ids": [1, 2], "sampling_params": {key: value}}, key)
       for key in ("temperature", "top_p", "min_p", "top_k", "max_new_tokens", "n")
       for label, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf")))},
    **{f"{key} subnormal": ({"input_ids": [1, 2], "sampling_params": {key: 1e-320}}, "subnormal")
       for key in ("temperature", "top_p", "min_p")},
    "temperature tiny": ({"input_ids": [1, 2], "sampling_params": {"temperature": 1e-9}}, "temperature"),
    "temperature huge int": ({"input_ids": [1, 2], "sampling_params": {"temperature": 10**400}}, "finite"),
    "top_k beyond int64": ({"input_ids": [1, 2], "sampling_params": {"top_k": 1e300}}, "top_k"),
    "max_new_tokens beyond int64": ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2**70}}, "out of range"),
    "seed 2**64": ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
    "seed negative": ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
    "seed nan": ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": float("nan")}}, "sampling_seed"),
    **{f"{key} nan": ({"input_ids": [1, 2], "sampling_params": {key: float("nan")}}, key)
       for key in ("frequency_penalty", "presence_penalty", "repetition_penalty")},
    "penalty inf": ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": float("inf")}}, "finite"),
}


def still_serving(client) -> None:
    r = client.post("/generate", json=OK)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("name", list(CASES))
def test_bad_generate_body_is_a_400_with_a_clear_message(client, name):
    body, needle = CASES[name]
    # json.dumps, unlike httpx's json=, writes NaN and Infinity (as Python clients, and SGLang, accept them)
    r = client.post("/generate", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert needle in message, message
    still_serving(client)


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"input_ids": [1, 2]', "\u00e9".encode("latin-1")])
def test_malformed_json_is_a_400(client, raw):
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "JSON" in r.json()["error"]["message"] or "empty" in r.json()["error"]["message"]
    still_serving(client)


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/pause_generation", {"mode": "sideways"}, "pause mode"),
        ("/abort_request", {}, "rid"),
        ("/update_weight_version", {}, "new_version"),
        ("/update_weights_from_disk", {}, "model_path"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}, "serialized_named_tensors"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": []}, "length"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, "init_weights_update_group"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1"}, "master_port"),
        ("/update_weights_from_delta", {}, "path"),
        ("/release_memory_occupation", {"tags": "weights"}, "tags"),
    ],
)
def test_bad_control_bodies_are_400(client, path, body, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    still_serving(client)


def test_known_sglang_fields_with_default_values_are_accepted(client):
    """What a re-serialising router sends (SGLang fields left at their defaults) must not be refused."""
    body = {
        **OK, "lora_path": None, "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False,
        "stream": False, "return_logprob": False, "rid": None,
        "sampling_params": {"max_new_tokens": 2, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "regex": None},
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text


def test_largest_seed_and_tiny_valid_temperature_sample(client):
    """The edges of the valid ranges still generate (seed 2**63-1 with n=4 seeds up to 2**63+2)."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "sampling_seed": 2**63 - 1, "n": 4,
                                                       "temperature": 1e-6, "ignore_eos": True},
            "return_logprob": True}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    for out in r.json():
        logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert len(out["output_ids"]) == 3 and all(lp <= 0.0 and lp == lp for lp in logprobs)
