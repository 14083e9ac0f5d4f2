"""Argument translation for the real-SGLang launcher (SGLang itself cannot run here)."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from agentrl.engine import sglang as launcher
from agentrl.engine.sglang import (
    SGLangProcess,
    SGLangServerConfig,
    add_sglang_arguments,
    sglang_launch_command,
    split_sglang_args,
    to_sglang_flags,
)


def test_split_keeps_sglang_flags_and_their_values_verbatim():
    argv = ["--model", "m", "--sglang-mem-fraction-static", "0.7", "--engines", "2",
            "--sglang-cuda-graph-bs", "1", "2", "4", "--sglang-disable-radix-cache",
            "--sglang-random-seed=-5", "--port", "9", "--sglang-offset", "-3"]
    own, passthrough = split_sglang_args(argv)
    assert own == ["--model", "m", "--engines", "2", "--port", "9"]
    assert passthrough == ["--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4",
                           "--sglang-disable-radix-cache", "--sglang-random-seed=-5", "--sglang-offset", "-3"]


def test_to_sglang_flags_strips_the_prefix_only_from_flags():
    assert to_sglang_flags(["--sglang-tp-size", "2", "--sglang-log-level=debug", "--sglang-x"]) == [
        "--tp-size", "2", "--log-level=debug", "--x"]


@pytest.mark.parametrize("flag", ["--sglang-port", "--sglang-model-path=/x", "--sglang-host"])
def test_owned_flags_are_refused(flag):
    with pytest.raises(ValueError, match="agentrl sets"):
        to_sglang_flags([flag, "1"])


def test_launch_command_from_config_plus_passthrough():
    cfg = SGLangServerConfig(
        model_path="/models/qwen", port=31000, dtype="bfloat16", tp_size=2, mem_fraction_static=0.6,
        enable_memory_saver=True, weight_version="v0",
        passthrough=["--sglang-attention-backend", "fa3", "--sglang-mem-fraction-static", "0.8"],
    )
    cmd = sglang_launch_command(cfg, python="py")
    assert cmd[:9] == ["py", "-m", "sglang.launch_server", "--model-path", "/models/qwen", "--host", "127.0.0.1", "--port", "31000"]
    rest = cmd[9:]
    assert rest[rest.index("--dtype") + 1] == "bfloat16"
    assert rest[rest.index("--tp-size") + 1] == "2"
    assert "--enable-memory-saver" in rest and rest[rest.index("--weight-version") + 1] == "v0"
    # the explicit passthrough value wins over agentrl's config (only one --mem-fraction-static)
    assert rest.count("--mem-fraction-static") == 1 and rest[rest.index("--mem-fraction-static") + 1] == "0.8"
    assert rest[-4:] == ["--attention-backend", "fa3", "--mem-fraction-static", "0.8"]


def test_default_config_adds_nothing_extra():
    assert sglang_launch_command(SGLangServerConfig(model_path="m"), python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "m", "--host", "127.0.0.1", "--port", "30000"]


def test_fallback_parser_without_sglang(monkeypatch):
    monkeypatch.setattr(launcher, "_sglang_server_args", lambda: None)
    parser = argparse.ArgumentParser()
    assert add_sglang_arguments(parser) is False
    ns = parser.parse_args(["--sglang-tp-size", "4", "--sglang-disable-radix-cache"])
    assert ns.sglang_tp_size == 4 and ns.sglang_disable_radix_cache is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--sglang-tp-size", "four"])


def test_wraps_sglangs_own_add_cli_args(monkeypatch):
    """slime's trick: SGLang's ServerArgs.add_cli_args registers on our parser, every flag prefixed."""

    class FakeServerArgs:
        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--model-path", "--model", type=str, required=True)
            parser.add_argument("--port", type=int, default=30000)
            parser.add_argument("--mem-fraction-static", type=float, default=None)
            parser.add_argument("--enable-foo", action="store_true")
            parser.add_argument("--kv-cache-dtype", dest="kv_dtype", default="auto", choices=["auto", "fp8_e5m2"])

    srt = types.ModuleType("sglang.srt")
    mod = types.ModuleType("sglang.srt.server_args")
    mod.ServerArgs = FakeServerArgs
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    monkeypatch.setitem(sys.modules, "sglang.srt", srt)
    monkeypatch.setitem(sys.modules, "sglang.srt.server_args", mod)
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)  # agentrl's own, untouched by the wrapper
    assert add_sglang_arguments(parser) is True
    ns = parser.parse_args(["--model", "m", "--sglang-mem-fraction-static", "0.5", "--sglang-enable-foo",
                            "--sglang-kv-cache-dtype", "fp8_e5m2"])
    assert ns.model == "m" and ns.sglang_mem_fraction_static == 0.5 and ns.sglang_enable_foo is True
    assert ns.sglang_kv_dtype == "fp8_e5m2"
    assert not hasattr(ns, "sglang_port") and not hasattr(ns, "sglang_model_path")  # owned by agentrl
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--sglang-kv-cache-dtype", "int3"])
    assert parser.add_argument.__name__ == "add_argument"  # restored


def test_sglang_process_builds_the_command_without_starting(tmp_path):
    proc = SGLangProcess(tmp_path, port=31234, dtype="bfloat16", sglang_args=["--sglang-tp-size", "2"])
    cmd = proc.command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--tp-size" in cmd and proc.url == "http://127.0.0.1:31234"
    assert not proc.alive
    with pytest.raises(ValueError):
        SGLangProcess(tmp_path, sglang_args=["--sglang-port", "1"])
