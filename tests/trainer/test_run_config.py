"""`agentrl train` configuration: YAML plus command-line overrides, validated."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentrl.trainer.run_config import load_config, parse_overrides

CONFIG = "examples/arithmetic/config.yaml"


def test_overrides_reach_nested_sections_and_keep_yaml_values():
    cfg = load_config(CONFIG, ["--rollout.num_engines", "1", "--trainer.lr=3e-4", "--steps", "7"])
    assert cfg.rollout.num_engines == 1 and cfg.steps == 7
    assert cfg.trainer["lr"] == 3e-4
    assert cfg.trainer["loss"]["eps_clip_high"] == 0.28  # from the YAML, untouched by the override
    assert parse_overrides(["--warmup.enabled", "false"]) == {"warmup": {"enabled": False}}


def test_trainer_temperature_follows_the_sampling_temperature():
    assert load_config(CONFIG, ["--rollout.temperature", "0.7"]).trainer["temperature"] == 0.7
    with pytest.raises(ValidationError, match="differs from rollout.temperature"):
        load_config(CONFIG, ["--trainer.temperature", "0.5"])


def test_unknown_field_and_bad_flag_are_errors():
    with pytest.raises(ValidationError):
        load_config(CONFIG, ["--rollout.num_engine", "1"])
    with pytest.raises(ValueError):
        parse_overrides(["steps", "3"])
