"""Plug-in points: dotted-path loading, a custom per-sample episode function, a custom rollout function."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from agentrl.envs import load_function
from agentrl.envs.arithmetic import ArithmeticEnv, make_tasks
from agentrl.envs.loop import generate_rollout, run_episode
from agentrl.envs.scripted import ScriptedPolicy

PLUGIN = textwrap.dedent('''
    from agentrl.envs.loop import run_episode, generate_rollout

    CALLS = []

    async def tagged_episode(env, task, generate, renderer, **kw):
        """A per-sample plug-in: wraps the default loop and tags its samples."""
        CALLS.append(kw["session_id"])
        result = await run_episode(env, task, generate, renderer, **kw)
        for sample in result.samples:
            sample.metadata["plugin"] = "tagged"
        return result

    async def twice(env_factory, tasks, generate, renderer, **kw):
        """A rollout plug-in: every task twice."""
        return await generate_rollout(env_factory, list(tasks) * 2, generate, renderer, **kw)

    NOT_CALLABLE = 3
''')


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_agentrl_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_agentrl_plugin"


def test_defaults_resolve_to_the_library_functions():
    assert load_function("agentrl.envs.loop:run_episode") is run_episode
    assert load_function("agentrl.envs.loop:generate_rollout") is generate_rollout
    assert load_function("agentrl.envs.loop.run_episode") is run_episode  # dotted form
    assert load_function("agentrl.envs.arithmetic:ArithmeticEnv.reward") is ArithmeticEnv.reward


@pytest.mark.parametrize(
    "path, error, fragment",
    [
        ("", ValueError, "package.module:function"),
        ("nodots", ValueError, "package.module:function"),
        ("no_such_module_xyz:fn", ImportError, "module 'no_such_module_xyz' not found"),
        ("agentrl.envs.loop:nope", ImportError, "has no attribute 'nope'"),
        ("agentrl.envs.loop:log.nope", ImportError, "has no attribute 'log.nope'"),
    ],
)
def test_bad_paths_give_clear_errors(path, error, fragment):
    with pytest.raises(error, match=fragment):
        load_function(path)


def test_not_callable_is_refused(plugin_module):
    with pytest.raises(TypeError, match="is a int, not a function"):
        load_function(f"{plugin_module}:NOT_CALLABLE")


def test_episode_plugin_replaces_the_per_sample_loop(plugin_module, tokenizer, renderer):
    tasks = make_tasks(2, seed=9)
    policy = ScriptedPolicy(tokenizer, ['<tool_call>{"name": "submit", "arguments": {"answer": 1}}</tool_call>'])
    result = asyncio.run(generate_rollout(ArithmeticEnv, tasks, policy, renderer, n_samples_per_task=2,
                                          episode_fn=f"{plugin_module}:tagged_episode"))
    module = __import__(plugin_module)
    assert sorted(module.CALLS) == sorted(e.session_id for e in result.episodes) and len(module.CALLS) == 4
    assert all(s.metadata["plugin"] == "tagged" for s in result.samples) and len(result.samples) == 4


def test_rollout_plugin_replaces_the_whole_rollout(plugin_module, tokenizer, renderer):
    rollout = load_function(f"{plugin_module}:twice")
    policy = ScriptedPolicy(tokenizer, ["no call"])
    result = asyncio.run(rollout(ArithmeticEnv, make_tasks(3), policy, renderer, n_samples_per_task=1))
    assert len(result.groups) == 6 and result.summary()["episodes"] == 6
