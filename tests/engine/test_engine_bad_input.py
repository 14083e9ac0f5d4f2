"""Bad input gets a 4xx with a message naming the problem; the engine keeps serving afterwards."""

from __future__ import annotations

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
}


def still_serving(client) -> None:
    r = client.post("/generate", json=OK)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("name", list(CASES))
def test_bad_generate_body_is_a_400_with_a_clear_message(client, name):
    body, needle = CASES[name]
    r = client.post("/generate", json=body)
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
