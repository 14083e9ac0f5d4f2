"""The Responses and Messages examples of docs/gateway.md run as written (the address swapped for a test
gateway with a scripted policy) and leave a session whose samples verify."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("anthropic")

from test_gateway import CALL, TOKENIZER_DIR, ServerThread, finish  # noqa: E402

from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.rollout.gateway import Gateway, create_app  # noqa: E402
from agentrl.trajectory import verify_session  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


def _example(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.mark.parametrize(("marker", "session"), [("client.responses.create", "episode-18"),
                                                 ("client.messages.create", "episode-19")])
def test_the_documented_example_records_a_proven_session(monkeypatch, marker, session):
    from transformers import AutoTokenizer

    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    gateway = Gateway(tokenizer, ScriptedPolicy(tokenizer, [CALL, "The answer is 5."]), model_name="m")
    with ServerThread(create_app(gateway)) as server:
        code = _example(marker).replace("http://127.0.0.1:8000", server.url)
        code = re.sub(r"^samples = httpx.post.*$", "", code, flags=re.M)  # finished below, keeping the turns
        exec(compile(code, str(DOC), "exec"), {})
        samples, turns = finish(server.url, session)
    verify_session(samples, turns)
    assert len(turns) == 2 and any(samples[0].loss_mask)
