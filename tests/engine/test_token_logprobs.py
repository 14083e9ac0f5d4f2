"""``POST /token_logprobs``: the log-probs of exactly the asked tokens, equal to the HF model's own; the tokens a
generation sampled score as the engine reported them; hostile bodies are refused with 400 and the engine serves on."""

from __future__ import annotations

import pytest


def _hf_logprobs(model_dir, ids: list[int], positions: list[int], temperature: float) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0] / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[p - 1, ids[p]]) for p in positions]


def test_scores_equal_the_hf_model_and_the_sampled_logprobs(client, tiny_model) -> None:
    ids = [1, 40, 41, 42, 43, 44, 45, 2]
    body = {"input_ids": [ids, ids[:4]], "positions": [[2, 5, 7], []], "temperature": 0.7}
    r = client.post("/token_logprobs", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["logprobs"][1] == [] and got["weight_version"] == "default"
    # SDPA in the engine against HF's eager-or-SDPA: float32 sums in another order, so a tolerance.
    assert got["logprobs"][0] == pytest.approx(_hf_logprobs(tiny_model, ids, [2, 5, 7], 0.7), abs=1e-4)

    gen = client.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                         "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3}}).json()
    out = gen["output_ids"]
    scored = client.post("/token_logprobs", json={"input_ids": [ids + out],
                                                  "positions": [list(range(len(ids), len(ids) + len(out)))]}).json()
    sampled = [lp for lp, _, _ in gen["meta_info"]["output_token_logprobs"]]
    assert scored["logprobs"][0] == pytest.approx(sampled, abs=1e-4)  # the sampler's log-probs, re-scored


@pytest.mark.parametrize("body, fragment", [
    ({"input_ids": [[1, 2]]}, "positions"),
    ({"input_ids": [], "positions": []}, "input_ids"),
    ({"input_ids": [[1, 2, 3]], "positions": [[1], [1]]}, "2 position lists for 1 sequences"),
    ({"input_ids": [[1]], "positions": [[]]}, "has 1 tokens"),
    ({"input_ids": [[1, 2, 3]], "positions": [[0]]}, "outside [1, 3)"),
    ({"input_ids": [[1, 2, 3]], "positions": [[3]]}, "outside [1, 3)"),
    ({"input_ids": [[1, 2, 3]], "positions": [[1] * 100_000]}, "strictly increasing"),
    ({"input_ids": [[1, 2, 3]], "positions": [[2, 1]]}, "strictly increasing"),
    ({"input_ids": [[1, 99999]], "positions": [[1]]}, "out of vocabulary"),
    ({"input_ids": [[1, -1]], "positions": [[1]]}, "out of vocabulary"),
    ({"input_ids": [[1, "2"]], "positions": [[1]]}, "input_ids"),
    ({"input_ids": [[1, True]], "positions": [[1]]}, "input_ids"),
    ({"input_ids": [[1, 2]], "positions": [[1]], "temperature": 0}, "temperature"),
    ({"input_ids": [[1, 2]], "positions": [[1]], "temperature": 1e-9}, "temperature"),
    ({"input_ids": [[1, 2]], "positions": [[1]], "top_k": 3}, "top_k"),
    ({"input_ids": [[1] * 5000], "positions": [[1]]}, "has 5000 tokens"),
    ({"input_ids": [[1, 2]] * 257, "positions": [[1]] * 257}, "input_ids"),
])
def test_hostile_bodies_are_refused(client, body, fragment) -> None:
    r = client.post("/token_logprobs", json=body)
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    assert client.post("/token_logprobs", json={"input_ids": [[1, 2]], "positions": [[1]]}).status_code == 200


def test_not_json_is_refused(client) -> None:
    r = client.post("/token_logprobs", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
