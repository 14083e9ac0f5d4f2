"""``model.tokenizer``: a plug-in that writes the tiny model's tokenizer; checked at load, sizes the
vocabulary, travels with the model directory and keys the cache."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from agentrl.run.config import RunConfig

PLUGIN = '''
from tokenizers import AddedToken
from transformers import AutoTokenizer

from agentrl.models.tiny import TOKENIZER_DIR


def two_names(out_dir):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tokenizer.add_tokens([AddedToken(n, normalized=False) for n in ("Nepal", "Kathmandu")])
    tokenizer.save_pretrained(out_dir)


def nothing(out_dir):
    pass
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "tok_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tok_plugin"


def test_a_bad_tokenizer_path_or_one_beside_a_model_path_fails_at_load(plugin):
    with pytest.raises(ValidationError, match="has no attribute 'nope'"):
        RunConfig.model_validate({"model": {"tokenizer": f"{plugin}:nope"}})
    with pytest.raises(ValidationError, match="a model.path brings its own"):
        RunConfig.model_validate({"model": {"tokenizer": f"{plugin}:two_names", "path": "/some/model"}})


def test_the_tokenizer_reaches_the_vocab_and_the_model_dir_and_keys_the_cache(plugin, tmp_path):
    from transformers import AutoTokenizer

    from agentrl.run.models import base_model_dir

    default = base_model_dir(RunConfig(cache_dir=str(tmp_path / "cache")))
    cfg = RunConfig.model_validate({"cache_dir": str(tmp_path / "cache"), "model": {"tokenizer": f"{plugin}:two_names"}})
    named = base_model_dir(cfg)
    assert named != default
    assert base_model_dir(cfg) == named  # the same tokenizer files: the cached model again
    vocab = [json.loads((d / "config.json").read_text())["vocab_size"] for d in (default, named)]
    assert vocab[1] == vocab[0] + 2
    tokenizer = AutoTokenizer.from_pretrained(named)
    ids = tokenizer("capital of Nepal is Kathmandu", add_special_tokens=False)["input_ids"]
    assert {"Nepal", "Kathmandu"} <= set(tokenizer.convert_ids_to_tokens(ids))
    assert tokenizer.chat_template  # the template came along


def test_a_tokenizer_plugin_that_writes_nothing_is_an_error_naming_it(plugin, tmp_path):
    from agentrl.run.models import base_model_dir

    cfg = RunConfig.model_validate({"cache_dir": str(tmp_path / "cache"), "model": {"tokenizer": f"{plugin}:nothing"}})
    with pytest.raises(ValueError, match="tok_plugin:nothing.*wrote no tokenizer_config.json"):
        base_model_dir(cfg)
