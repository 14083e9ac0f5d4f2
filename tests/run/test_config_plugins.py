"""Every plug-in point of the run config refuses a bad name, a bad class path and a bad option at load,
before Ray: the points are found by walking the config models, so a new plug-in field cannot be missed."""

from __future__ import annotations

import subprocess
import sys
import time
import types
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

from agentrl.run.config import RunConfig, load_config
from agentrl.settings import FunctionPath
from agentrl.weights.sync import MODES, payload_class
from agentrl.weights.transport import TRANSPORTS, TransportOptions, transport_class

CONFIG = "examples/arithmetic/config.yaml"
PLUGIN_WORDS = ("module:", "module.attr")  # how every plug-in field's description says it takes a path


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models(arg)]


def _is_function_path(field: Any) -> bool:
    marks = {id(m) for m in get_args(FunctionPath)[1:]}
    return any(id(m) in marks for m in field.metadata) or any(
        get_origin(a) is Annotated and id(get_args(a)[1]) in marks
        for a in get_args(field.annotation) if get_origin(field.annotation) in (Union, types.UnionType))


def plugin_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every field taking a plug-in: FunctionPath-typed, or described as taking module:attr."""
    found = []
    for name, field in model.model_fields.items():
        subs = _models(field.annotation)
        if subs:
            for sub in subs:
                found += plugin_fields(sub, f"{prefix}{name}.")
        elif _is_function_path(field) or any(w in (field.description or "") for w in PLUGIN_WORDS):
            found.append(f"{prefix}{name}")
    return sorted(set(found))


POINTS = plugin_fields()


def test_the_walk_finds_the_plug_in_points_we_know() -> None:
    known = {"env", "tasks", "expert", "sync_mode", "sync_options.transport", "group_filter", "report_to",
             "model.tokenizer", "rollout.policy", "rollout.tool_format", "trainer.advantage_fn", "trainer.credit_fn",
             "trainer.loss.log_ratio", "trainer.loss.importance_weights"}
    assert known <= set(POINTS), sorted(known - set(POINTS))


def _override(point: str, value: str) -> list[str]:
    if point == "sync_options.transport":
        return ["--sync_options", f'{{"transport": "{value}"}}']
    if point == "report_to":
        return ["--report_to", f'["{value}"]']
    return [f"--{point}", value]


BAD_VALUES = {
    "name": "bogus",  # no built-in has this name, and it is no path
    "module": "no_such_pkg_xyz.mod:thing",  # a class path whose module does not exist
    "attribute": "agentrl.plugins:no_such_thing",  # a module without that attribute
}


@pytest.mark.parametrize("kind", sorted(BAD_VALUES))
@pytest.mark.parametrize("point", POINTS)
def test_a_bad_plug_in_is_refused_at_load_naming_the_field(point: str, kind: str) -> None:
    overrides = _override(point, BAD_VALUES[kind])
    with pytest.raises(ValidationError) as err:
        load_config(CONFIG, overrides)
    text = str(err.value)
    assert point.split(".")[0] in text and BAD_VALUES[kind].split(":")[0] in text, text


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_bad_option_of_every_payload_and_transport_is_refused_with_the_nearest_key(mode: str) -> None:
    payload = payload_class(mode)
    for name in TRANSPORTS:
        if not (payload.payload in transport_class(name).carries and (mode not in TRANSPORTS or mode == name)):
            continue
        options = transport_class(name).Options
        key = next((k for k in options.model_fields if k not in TransportOptions.model_fields), "transport")
        typo = key[:-1] + "z"  # one letter off a real option
        with pytest.raises(ValidationError, match=rf"unknown key '{typo}' .*did you mean '{key}'\?"):
            load_config(CONFIG, ["--sync_mode", mode, "--sync_options", f'{{"transport": "{name}", "{typo}": 1}}'])
        with pytest.raises(ValidationError, match=r"sync_options"):  # a real option, a wrong type
            load_config(CONFIG, ["--sync_mode", mode, "--sync_options", f'{{"transport": "{name}", "{key}": {{}}}}'])


def test_a_transport_that_cannot_carry_the_payload_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match=r"tensor transport cannot carry delta payloads"):
        load_config(CONFIG, ["--sync_mode", "delta", "--sync_options", '{"transport": "tensor"}'])


@pytest.mark.parametrize("options", ['{"transprt": "disk"}', '{"transport": "bogus"}'])
def test_agentrl_train_with_bad_sync_options_exits_fast_before_ray(options: str, tmp_path) -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", CONFIG, "--sync_options", options,
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    if "transprt" in options:
        assert "'transprt'" in proc.stderr and "did you mean 'transport'?" in proc.stderr
    else:
        assert "unknown weight-sync transport 'bogus'" in proc.stderr and "Traceback" not in proc.stderr
    assert "ray" not in proc.stderr.lower().replace("array", "")  # nothing started
    assert not (tmp_path / "run").exists()
    assert seconds < 30  # the bar is 10 s on an idle machine; a loaded CI box gets slack


@pytest.mark.parametrize(("text", "kind"), [("- steps: 3\n- rollout: {}\n", "list"), ("just words\n", "str"),
                                            ("42\n", "int")])
def test_a_yaml_config_that_is_not_a_mapping_is_one_clear_line(text: str, kind: str, tmp_path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"a config is a mapping of keys to values .*holds a {kind}$") as err:
        load_config(path)
    assert "dictionary update sequence" not in str(err.value) and "\n" not in str(err.value)
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and kind in proc.stderr


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("steps: 3\nrollout: {num_engines: 1\n")
    with pytest.raises(ValueError, match=rf"{path.name}: not valid YAML \(line \d+\)"):
        load_config(path)
