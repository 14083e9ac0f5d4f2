"""`agentrl train` configuration: YAML plus command-line overrides, one typed model, validated at load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.run.config import RunConfig, load_config, parse_overrides

CONFIG = "examples/arithmetic/config.yaml"


def test_overrides_reach_nested_sections_and_keep_yaml_values():
    cfg = load_config(CONFIG, ["--rollout.num_engines", "1", "--trainer.lr=3e-4", "--steps", "7"])
    assert cfg.rollout.num_engines == 1 and cfg.steps == 7
    assert cfg.trainer.lr == 3e-4
    assert cfg.trainer.loss.eps_clip_high == 0.28  # from the YAML, untouched by the override
    assert parse_overrides(["--warmup.enabled", "false"]) == {"warmup": {"enabled": False}}


def test_the_temperature_is_declared_once_as_the_rollouts():
    assert load_config(CONFIG, ["--rollout.temperature", "0.7"]).rollout.temperature == 0.7
    with pytest.raises(ValidationError, match="rollout.temperature"):
        load_config(CONFIG, ["--trainer.temperature", "0.5"])
    with pytest.raises(ValidationError, match="finite"):
        load_config(CONFIG, ["--rollout.temperature", "NaN"])


def test_unknown_field_and_bad_flag_are_errors():
    with pytest.raises(ValidationError):
        load_config(CONFIG, ["--rollout.num_engine", "1"])
    with pytest.raises(ValueError):
        parse_overrides(["steps", "3"])


@pytest.mark.parametrize(("override", "key", "section", "nearest"), [
    (["--trainer.lrr", "1e-5"], "lrr", "TrainerConfig", "lr"),
    (["--trainer.loss.kl_coeff", "0.1"], "kl_coeff", "LossConfig", "kl_coef"),
    (["--rollout.num_engine", "1"], "num_engine", "RolloutSettings", "num_engines"),
    (["--warmup.target_acc", "0.3"], "target_acc", "WarmupConfig", "target_accuracy"),
    (["--stepz", "3"], "stepz", "RunConfig", "steps"),
])
def test_an_unknown_key_names_itself_its_section_and_the_nearest_key(override, key, section, nearest):
    with pytest.raises(ValidationError) as err:
        load_config(CONFIG, override)
    assert f"unknown key {key!r} in {section} (did you mean {nearest!r}?)" in str(err.value)


@pytest.mark.parametrize(("override", "fragment"), [
    (["--trainer.lr", "fast"], "lr"),
    (["--rollout.num_engines", "0"], "num_engines"),
    (["--schedule", "sometimes"], "schedule"),
    (["--loop", "sync"], "renamed: set it as schedule"),
])
def test_a_wrong_type_or_value_names_the_field(override, fragment):
    with pytest.raises(ValidationError, match=fragment):
        load_config(CONFIG, override)


@pytest.mark.parametrize(("override", "fragment"), [
    (["--trainer.credit_fn", "agentrl.trainer.credit:nope"], "has no attribute 'nope'"),
    (["--trainer.advantage_fn", "no_such_pkg.mod:fn"], "module 'no_such_pkg.mod' not found"),
    (["--trainer.loss.log_ratio", "sideways"], "unknown loss.log_ratio 'sideways'"),
    (["--rollout.policy", "agentrl.trajectory.sample:Sample"], "not a DriftPolicy subclass"),
    (["--env", "agentrl.envs.arithmetic:make_tasks"], "not a Environment subclass"),
    (["--group_filter", "agentrl.rollout.buffer.nope"], "has no attribute 'nope'"),
    (["--sync_mode", "carrier-pigeon"], "unknown weight-sync mode 'carrier-pigeon'"),
    (["--expert", "examples.nope:expert"], "module 'examples.nope' not found"),
])
def test_a_bad_plugin_path_fails_at_load_naming_what_it_looked_for(override, fragment):
    with pytest.raises((ValidationError, TypeError), match=fragment):
        load_config(CONFIG, override)


def test_plugin_paths_take_both_spellings():
    cfg = load_config(CONFIG, ["--trainer.credit_fn", "agentrl.trainer.credit:withhold_positive_credit_from_ill_formed_turns",
                               "--trainer.advantage_fn", "agentrl.trainer.losses.dr_grpo_advantages",
                               "--rollout.policy", "agentrl.trajectory.policies:ForkPolicy"])
    assert cfg.trainer.credit_fn.endswith(":withhold_positive_credit_from_ill_formed_turns")


def test_defaults_do_not_come_from_the_demo():
    cfg = RunConfig()
    assert cfg.task_kwargs == {} and cfg.expert is None and not cfg.runs_warmup
    assert load_config(CONFIG).runs_warmup  # the arithmetic job names its expert


def test_colocate_needs_the_sync_schedule():
    with pytest.raises(ValidationError, match="colocate"):
        load_config(CONFIG, ["--colocate", "true", "--schedule", "async"])


def test_agentrl_train_with_a_typo_exits_fast_before_ray_naming_the_key(tmp_path):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", CONFIG, "--trainer.lrr", "1e-5",
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - started
    assert proc.returncode == 2 and "'lrr'" in proc.stderr and "did you mean 'lr'?" in proc.stderr
    assert "ray" not in proc.stderr.lower().replace("array", "")  # nothing started
    assert not (tmp_path / "run").exists()  # nothing written
    assert seconds < 30  # the bar is 10 s on an idle machine; a loaded CI box gets slack


def test_print_config_shows_the_resolved_config():
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", CONFIG, "--print-config", "--steps", "3"],
                          capture_output=True, text=True, timeout=60)
    import json

    resolved = json.loads(proc.stdout)
    assert proc.returncode == 0 and resolved["steps"] == 3 and resolved["trainer"]["lr"] == 3e-4  # the YAML's, not the default
    import yaml

    written = yaml.safe_load(Path(CONFIG).read_text())["rollout"]["temperature"]
    assert resolved["rollout"]["temperature"] == written and "temperature" not in resolved["trainer"]


def test_the_config_reference_is_current_and_documents_every_field():
    from pathlib import Path

    from agentrl.run.reference import config_reference

    text = config_reference()
    assert Path("docs/config.md").read_text() == text, "regenerate: python -m agentrl.run.reference > docs/config.md"
    undocumented = [line for line in text.splitlines() if line.startswith("| `") and line.endswith("|  |")]
    assert undocumented == []
    for key in ("`trainer.lr`", "`trainer.loss.log_ratio`", "`rollout.temperature`", "`warmup.target_accuracy`"):
        assert key in text


def test_the_console_script_finds_plug_ins_in_the_working_directory(tmp_path):
    import os
    import shutil

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "env.py").write_text("from agentrl.envs.arithmetic import ArithmeticToolEnv as MyEnv\n")
    script = shutil.which("agentrl")
    assert script, "the agentrl console script is installed"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([script, "train", "--env", "mine.env:MyEnv", "--print-config"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert '"env": "mine.env:MyEnv"' in proc.stdout


def test_the_tiny_models_shape_is_configurable_checked_at_load_and_keys_its_cache(tmp_path):
    from agentrl.run.models import base_model_dir

    with pytest.raises(ValidationError, match="even head size"):
        RunConfig.model_validate({"model": {"hidden_size": 100, "num_attention_heads": 4}})
    with pytest.raises(ValidationError, match="must divide"):
        RunConfig.model_validate({"model": {"num_attention_heads": 4, "num_key_value_heads": 3}})
    default = base_model_dir(RunConfig(cache_dir=str(tmp_path)))
    deeper = base_model_dir(RunConfig.model_validate({"cache_dir": str(tmp_path), "model": {"num_hidden_layers": 3}}))
    assert default != deeper
    layers = [json.loads((d / "config.json").read_text())["num_hidden_layers"] for d in (default, deeper)]
    assert layers == [2, 3]
