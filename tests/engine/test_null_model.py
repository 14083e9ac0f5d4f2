"""The null model (``python -m agentrl.engine --null-model``): scripted replies through the real server and
scheduler, chosen by how many marker tokens the prompt holds; a bad script is refused before serving."""

from __future__ import annotations

import json

import pytest

from agentrl.engine.null_model import NullRunner, NullScript


def make_app(tiny_model, script: NullScript):
    from agentrl.engine.engine import Engine, EngineConfig
    from agentrl.engine.server import create_app

    config = EngineConfig(model_path=str(tiny_model), lean_decode=False)
    return create_app(Engine(config, runner=NullRunner(str(tiny_model), script)))


def generate(client, ids: list[int], **params) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 1.0, **params},
                                       "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_replies_follow_the_marker_count_and_end_with_eos(tiny_model):
    from fastapi.testclient import TestClient

    script = NullScript(replies=[[10, 11, 12], [20, 21]], marker=7, first=1, per_turn=2, logprob=-0.5)
    with TestClient(make_app(tiny_model, script)) as client:
        eos = client.app.state.engine.runner.end
        first = generate(client, [7, 3, 4])  # one marker: (1 - 1) // 2 = reply 0
        assert first["output_ids"] == [10, 11, 12, eos]
        assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
        assert [lp for lp, _, _ in first["meta_info"]["output_token_logprobs"]] == [-0.5] * 4  # as scripted
        assert generate(client, [7, 7, 7, 5])["output_ids"] == [20, 21, eos]  # three markers: reply 1
        assert generate(client, [7] * 9)["output_ids"] == [20, 21, eos]  # past the last reply: the last one
        assert generate(client, [5], max_new_tokens=2)["output_ids"] == [10, 11]  # too few markers: reply 0
        assert generate(client, [5], ignore_eos=True, max_new_tokens=6)["output_ids"] == [10, 11, 12, eos, eos, eos]


@pytest.mark.parametrize(("text", "needle"), [
    ("{", "not a null-model script"),
    (json.dumps({"marker": 1}), "replies"),
    (json.dumps({"replies": [], "marker": 1}), "non-empty replies"),
    (json.dumps({"replies": [[1], []], "marker": 1}), "non-empty replies"),
    (json.dumps({"replies": [[1]], "marker": 1, "per_turn": 0}), "per_turn"),
    (json.dumps({"replies": [["x"]], "marker": 1}), "not a null-model script"),
])
def test_a_bad_script_is_a_clear_error(tmp_path, text, needle):
    path = tmp_path / "script.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle):
        NullScript.load(path)


def test_replies_outside_the_vocabulary_are_refused(tiny_model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        NullRunner(str(tiny_model), NullScript(replies=[[10**9]], marker=1))


def test_the_cli_refuses_a_bad_script_before_serving(tiny_model, tmp_path, capsys):
    from agentrl.engine.__main__ import main

    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tiny_model), "--null-model", str(bad), "--device", "cpu"])
    assert exc.value.code == 2 and str(bad) in capsys.readouterr().err
