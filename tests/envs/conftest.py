from __future__ import annotations

from pathlib import Path

import pytest

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def renderer(tokenizer):
    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(tokenizer)
