"""The trainable coding agent (``examples/coding_agent/config.yaml``): the one-liner task family, the
``FunctionEnv`` tools and reward in Docker sandboxes, the pooled grader, the sandbox metrics, an episode
whose sandbox is killed (failed and dropped, never a reward of 0), and the example trained for two GRPO
steps at toy size with no container left behind.

Tests marked ``docker`` need the Docker engine and the sandbox image (``bash scripts/docker_setup``):
under CI they fail when either is missing, elsewhere they skip with the reason.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
from pathlib import Path

import pytest

from agentrl.envs import generate_rollout, run_episode
from agentrl.envs.formats import HermesFormat, ToolCall
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.rollout.buffer import DataBuffer
from agentrl.trajectory import verify_session
from examples.coding_agent import oneliners
from examples.coding_agent.function_env import (
    LABELS,
    NO_SOLUTION,
    SAVED,
    FunctionEnv,
    SandboxFailure,
    expert_messages,
    expert_messages_with_repairs,
    expert_replies,
    make_tasks,
    near_miss_body,
    solution_module,
    visible_report,
)
from examples.coding_agent.meter import SandboxMeter, percentile

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "coding_agent" / "config.yaml"
TOKENIZER_DIR = REPO / "tests" / "assets" / "tiny_tokenizer"
FMT = HermesFormat()


@functools.cache
def docker_problem() -> str | None:
    from agentrl.sandbox.engine_setup import docker_problem as problem

    return problem()


def require_docker() -> None:
    problem = docker_problem()
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {problem}", pytrace=False)
    pytest.skip(problem)


@pytest.fixture
def docker() -> None:
    require_docker()


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def sandboxes():
    """A small agent pool and pooled grader for this module, removed at its end."""
    require_docker()
    from agentrl.sandbox import PooledGrader, SandboxPool
    from agentrl.sandbox.backend import make_sandbox

    pool = SandboxPool(size=2, factory=lambda: make_sandbox("docker", labels=LABELS, role="pool"))
    grader = PooledGrader(size=1, backend="docker", labels=LABELS, max_uses=100)
    with pool, grader:
        yield pool, grader


def call(name: str, **arguments) -> str:
    return FMT.render_calls([ToolCall(name, arguments)])


def play(renderer, task, replies, sandboxes, env_cls=FunctionEnv):
    pool, grader = sandboxes
    policy = ScriptedPolicy(renderer.tokenizer, replies)
    env = env_cls(pool=pool, grader=grader)
    result = asyncio.run(run_episode(env, task, policy, renderer, session_id="ep"))
    verify_session(result.samples, policy.turns["ep"])
    return result, env


def tool_messages(result) -> list[str]:
    return [m["content"] for m in result.messages if m["role"] == "tool"]


def docker_api():
    from agentrl.sandbox.docker_client import docker_client

    return docker_client().api


# ---- the task family (no Docker) ---------------------------------------------------------------------
def test_tasks_are_seeded_disjoint_and_hide_their_tests():
    assert make_tasks(20, seed=3) == make_tasks(20, seed=3) != make_tasks(20, seed=4)
    specs = {split: {oneliners.spec_key(t["spec"]) for t in make_tasks(1000 if split != "heldout" else 200, seed=0,
                                                                       split=split, level=2)}
             for split in oneliners.SPLITS}
    assert all(specs.values())
    # Held-out specs are never trained on, and GRPO's specs ("train") are none the warm-up showed.
    assert not specs["heldout"] & (specs["train"] | specs["warmup"]) and not specs["train"] & specs["warmup"]
    assert make_tasks.warmup_split == "warmup"  # agentrl.run.data.FunctionTasks draws the warm-up's chats there
    assert make_tasks(2, seed=0, split="warmup", family="humaneval") == make_tasks(2, seed=0, family="humaneval")
    for task in make_tasks(50, seed=1, split="heldout", level=2):
        assert task["family"] == "oneliner" and "test" not in json.dumps(task)  # no hidden test in the task
        visible = task["examples"][0]["call"]
        assert f">>> {visible}" in task["prompt"]
        tests = oneliners.hidden_tests(task)["test_solution.py"]
        assert tests.count("def test_") == oneliners.HIDDEN_CASES and visible not in tests
    levels = {len(t["spec"]["ops"]) for t in make_tasks(200, seed=0, level=2)}
    assert levels == {1, 2} and {len(t["spec"]["ops"]) for t in make_tasks(200, seed=0, level=1)} == {1}
    with pytest.raises(ValueError, match="split must be one of"):
        make_tasks(1, split="test")
    with pytest.raises(ValueError, match="level must be one of"):
        make_tasks(1, level=3)
    with pytest.raises(ValueError, match="family must be one of"):
        make_tasks(1, family="leetcode")


def test_heldout_tasks_are_distinct_specs_while_fresh_ones_remain():
    """64 held-out tasks are 64 different specs (the eval measures 64 items), spread over the operations."""
    for level in oneliners.LEVELS:
        held = make_tasks(64, seed=0, split="heldout", level=level)
        assert len({oneliners.spec_key(t["spec"]) for t in held}) == 64
        assert len({t["spec"]["ops"][0] for t in held}) >= 12
    tiny = make_tasks(3, seed=0, split="heldout")
    assert tiny == make_tasks(3, seed=0, split="heldout") and len({oneliners.spec_key(t["spec"]) for t in tiny}) == 3


def test_credit_rule_trains_only_above_average_episodes():
    from agentrl.trainer.actor import _narrowed
    from examples.coding_agent.credit import train_above_average_only

    samples = [{"loss_mask": [0, 1, 1], "reward": r} for r in (1.0, 0.0, 0.5)]
    out = _narrowed(samples, train_above_average_only(samples, [0.8, -0.8, 0.0]))  # the trainer's check
    assert [s["loss_mask"] for s in out] == [[0, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert out[0] is samples[0] and samples[1]["loss_mask"] == [0, 1, 1]  # inputs untouched


def test_credit_rule_gives_no_credit_to_a_write_that_a_later_write_replaced():
    from agentrl.trainer.actor import _narrowed
    from examples.coding_agent.credit import train_above_average_only_without_superseded_writes as rule

    # prompt [0, 4), then turns: write (model 4-6), tool result, run_tests (7-8), result, write (10-11), submit (13)
    provenance = [[0, 4, "prompt", 0, None], [4, 6, "model", 0, "0"], [6, 7, "context", 1, None],
                  [7, 8, "model", 1, "0"], [8, 10, "context", 2, None], [10, 12, "model", 2, "0"],
                  [12, 13, "context", 3, None], [13, 14, "model", 3, "0"]]
    calls = [["write"], ["run_tests"], ["write"], ["submit"]]
    metadata = {"turns": [0, 1, 2, 3], "turn_metadata": [{"tool_calls": c} for c in calls]}
    mask = [1, 1, 0, 1, 0, 0, 1, 1, 0, 1]  # response tokens 4..13
    repaired = {"response_start": 4, "loss_mask": mask, "provenance": provenance, "metadata": metadata, "reward": 1.0}
    single = {**repaired, "metadata": {"turns": [0, 1], "turn_metadata": [{"tool_calls": ["write"]},
                                                                           {"tool_calls": ["submit"]}]}}
    samples = [repaired, single, {**repaired, "reward": 0.0}]
    out = _narrowed(samples, rule(samples, [0.9, 0.4, -0.9]))
    assert [s["loss_mask"] for s in out] == [[0, 0, 0, 1, 0, 0, 1, 1, 0, 1], mask, [0] * 10]
    assert repaired["loss_mask"] == mask  # inputs untouched


def test_reference_bodies_pass_their_hidden_tests_and_examples():
    """Every operation's reference (run here on the host: it is our own template code) passes its
    visible example and all hidden tests, for many seeds of both levels."""
    import ast

    for level in oneliners.LEVELS:
        for task in make_tasks(150, seed=7, level=level):
            namespace: dict = {}
            exec(solution_module(task, oneliners.solution_body(task)), namespace)  # noqa: S102
            example = task["examples"][0]
            assert eval(example["call"], namespace) == ast.literal_eval(example["expected"])  # noqa: S307
            tests = oneliners.hidden_tests(task)["test_solution.py"].replace("from solution import f", "")
            exec(tests, namespace)  # noqa: S102
            for name in [n for n in namespace if n.startswith("test_")]:
                namespace[name]()
    assert {op.name for op in oneliners.OPS} <= {n for t in make_tasks(2000, seed=0) for n in t["spec"]["ops"]}


def test_config_loads_and_the_expert_chat_fits_the_tiny_context(renderer):
    from agentrl.envs import load_function
    from agentrl.run.config import load_config

    cfg = load_config(CONFIG)
    assert load_function(cfg.env) is FunctionEnv and load_function(cfg.expert) is expert_messages
    assert cfg.model.max_position_embeddings == 512 and cfg.task_kwargs["family"] == "oneliner"
    lengths = []
    for task in make_tasks(200, seed=0, **cfg.task_kwargs):
        chat = expert_messages(task)
        rendered = renderer.render(chat, FunctionEnv.tool_schemas(), add_generation_prompt=False)
        trained = [t for t, m in zip(rendered.ids, rendered.assistant_mask, strict=True) if m]
        eos = renderer.tokenizer.eos_token
        assert renderer.tokenizer.decode(trained, skip_special_tokens=False) == "".join(
            r + eos for r in expert_replies(task))
        lengths.append(len(rendered.ids))
    assert max(lengths) < 400  # whole episodes fit 512 positions with room for longer replies
    humaneval = make_tasks(2, seed=0, split="heldout", family="humaneval")
    assert all(t["family"] == "humaneval" and t["prompt"] in expert_messages(t)[1]["content"] for t in humaneval)


def test_the_examples_tokenizer_makes_names_and_constants_one_token_the_same_everywhere(tmp_path, renderer):
    """With ``model.tokenizer`` (examples/coding_agent/tokenizer.py) an argument name is one token, the same id
    in the signature, the docstring and the body, a spelled-out constant is one token, and the expert's write is
    a few tokens; chats (and HumanEval prompts) decode to the same text as with the plain tiny tokenizer."""
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer
    from agentrl.run.config import load_config
    from examples.coding_agent.tokenizer import write_tokenizer

    assert load_config(CONFIG).model.tokenizer == "examples.coding_agent.tokenizer:write_tokenizer"
    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    fitted = ChatRenderer(tokenizer)
    added = set(tokenizer.get_added_vocab())
    assert set(oneliners.NAMES) | {" " + w for w in oneliners.NUMBER_WORDS} <= added
    for task in make_tasks(60, seed=0, split="heldout") + make_tasks(60, seed=1, split="warmup"):
        chat = expert_messages(task)
        ids = fitted.render(chat, FunctionEnv.tool_schemas(), add_generation_prompt=False).ids
        plain = renderer.render(chat, FunctionEnv.tool_schemas(), add_generation_prompt=False).ids
        assert tokenizer.decode(ids) == renderer.tokenizer.decode(plain) and len(ids) < len(plain)
        pieces = tokenizer.convert_ids_to_tokens(ids)
        for name in task["spec"]["args"]:  # signature, docstring, write: one token each time
            assert pieces.count(name) >= 3, (name, pieces)
        k = task["spec"]["ks"][0]
        if k is not None:
            assert " " + oneliners.NUMBER_WORDS[k] in pieces
        write = tokenizer(expert_replies(task)[0], add_special_tokens=False)["input_ids"]
        assert len(write) <= 12, tokenizer.convert_ids_to_tokens(write)
    prompt = make_tasks(1, seed=0, family="humaneval")[0]["prompt"]
    assert tokenizer.decode(tokenizer(prompt, add_special_tokens=False)["input_ids"]) == prompt


def test_repair_chats_write_a_near_miss_read_its_failure_then_write_the_reference(renderer):
    tasks = make_tasks(300, seed=0)
    chats = [expert_messages_with_repairs(t) for t in tasks]
    repaired = [(t, c) for t, c in zip(tasks, chats, strict=True) if c != expert_messages(t)]
    assert 0.2 < len(repaired) / len(tasks) < 0.4  # REPAIR_PERCENT of the chats, the rest unchanged
    kinds = set()
    for task, chat in repaired:
        wrong = near_miss_body(task)
        assert [m["content"] for m in chat if m["role"] == "assistant"] == [
            call("write", code=wrong), call("run_tests"), *expert_replies(task)]
        report = chat[5]["content"]
        assert report.startswith("FAIL") and report.endswith("0/1 examples passed") and report == visible_report(task, wrong)
        kinds.add("NameError" if "NameError" in report else "value")
        assert wrong != oneliners.solution_body(task)
        ids = renderer.render(chat, FunctionEnv.tool_schemas(), add_generation_prompt=False).ids
        assert len(ids) < 500  # the submit turn still fits the tiny model's 512 positions
    assert kinds == {"NameError", "value"}
    # Held-out chats (the warm-up's teacher-forced check) stay the plain expert's.
    assert all(expert_messages_with_repairs(t) == expert_messages(t) for t in make_tasks(100, seed=0, split="heldout"))
    assert visible_report(tasks[0], oneliners.solution_body(tasks[0])).endswith("1/1 examples passed")
    assert visible_report(tasks[0], "return (").startswith("solution.py failed to import: SyntaxError")


def test_meter_reports_counts_rates_and_percentiles():
    meter = SandboxMeter()
    assert percentile([5.0], 99) == 5.0 and percentile([float(i) for i in range(1, 101)], 50) == 50.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    meter.record("write", 10.0, 10.001)
    for i in range(10):
        meter.record("run_tests", 10.0 + i * 0.1, 10.0 + i * 0.1 + 0.01)
    meter.record("grade", 10.5, 12.0)
    meter.add("grade_run", 1.2)  # the hidden-test run inside that grade, as the sandbox timed it
    meter.failed()
    out = meter.report()
    assert out["sandbox/ops"] == 13 and out["sandbox/execs"] == 11 and out["sandbox/failed_episodes"] == 1
    assert out["sandbox/execs_per_s"] == pytest.approx(11 / 2.0)  # 11 commands over 10.0 .. 12.0 s
    assert out["sandbox/run_tests_p50_ms"] == pytest.approx(10.0) and out["sandbox/grade_p99_ms"] == pytest.approx(1500)
    assert out["sandbox/exec_p99_ms"] == pytest.approx(1200) and out["sandbox/exec_p50_ms"] == pytest.approx(10.0)
    assert meter.report() == {"sandbox/failed_episodes": 0.0, "sandbox/ops": 0.0, "sandbox/execs": 0.0}  # reset


# ---- episodes in Docker sandboxes --------------------------------------------------------------------
@pytest.mark.docker
def test_expert_scores_1_and_replays_its_chat(docker, renderer, sandboxes):
    for task in [*make_tasks(3, seed=0, split="heldout", level=2), *make_tasks(1, seed=0, family="humaneval")]:
        result, env = play(renderer, task, expert_replies(task), sandboxes)
        assert result.metrics.reward == 1.0 and env.grade.passed, (task["task_id"], env.grade)
        assert result.messages == expert_messages(task)  # the warm-up chat is what the env answers
    assert sandboxes[0].idle_count == 2  # every sandbox went back


@pytest.mark.docker
def test_a_repair_chat_replays_through_the_sandbox_word_for_word(docker, renderer, sandboxes):
    """The warm-up's repair chats quote the FAIL text the sandbox's run_tests really gives."""
    tasks = [t for t in make_tasks(40, seed=3) if expert_messages_with_repairs(t) != expert_messages(t)][:3]
    assert tasks
    for task in tasks:
        chat = expert_messages_with_repairs(task)
        result, env = play(renderer, task, [m["content"] for m in chat if m["role"] == "assistant"], sandboxes)
        assert result.messages == chat and result.metrics.reward == 1.0


@pytest.mark.docker
def test_only_the_hidden_tests_decide(docker, renderer, sandboxes):
    task = next(t for t in make_tasks(50, seed=2) if t["spec"]["ops"] == ["odd"])
    example = task["examples"][0]
    wrong = "return []"
    result, env = play(renderer, task, [call("run_tests"), call("write", code=wrong), call("run_tests"),
                                        call("submit")], sandboxes)
    feedback = tool_messages(result)
    assert feedback[0] == NO_SOLUTION and feedback[1] == SAVED
    assert feedback[2].startswith("FAIL") or example["expected"] == "[]"
    assert result.metrics.reward == 0.0 and env.grade.reason.endswith("tests failed")
    # Hard-coding the visible example passes run_tests but not the hidden tests.
    cheat = f"return {example['expected']}"
    result, env = play(renderer, task, [call("write", code=cheat), call("run_tests"), call("submit")], sandboxes)
    assert tool_messages(result)[1].endswith("1/1 examples passed") and result.metrics.reward == 0.0
    # A body that never returns: run_tests and the grade time out; reward 0, not a failed episode.
    result, env = play(renderer, task, [call("write", code="while True:\n    pass"), call("submit")], sandboxes)
    assert result.metrics.reward == 0.0 and result.metrics.error is None and env.grade.reason == "timed out"


@pytest.mark.docker
def test_pooled_grader_agrees_with_the_fresh_grader_and_leaks_nothing(docker, sandboxes):
    from agentrl.sandbox import Grader

    _, pooled = sandboxes
    tests = {"test_solution.py": "from solution import f\n\ndef test_a():\n    assert f(2) == 4\n"}
    cases = {
        "pass": "def f(x):\n    return x * 2\n",
        "fail": "def f(x):\n    return x + 3\n",
        "exit": "import os\nos._exit(0)\n",
        # Leaves a process and files behind for the next grade in the same (reused) sandbox.
        "stay": ("import os, subprocess\nopen('/tmp/planted', 'w').write('x')\nopen('sitecustomize.py', 'w').write('')\n"
                 "subprocess.Popen(['sleep', '300'], start_new_session=True)\ndef f(x):\n    return x * 2\n"),
    }
    fresh = Grader(backend="docker")
    for name, code in cases.items():
        got, want = pooled.grade({"solution.py": code}, tests), fresh.grade({"solution.py": code}, tests)
        assert (got.passed, got.reason) == (want.passed, want.reason), name
    probe = ("import os\nps = [open(f'/proc/{p}/cmdline').read() for p in os.listdir('/proc') if p.isdigit()]\n"
             "assert not os.path.exists('/tmp/planted') and not os.path.exists('sitecustomize.py')\n"
             "assert 'sleep\\x00300\\x00' not in ps, ps\ndef f(x):\n    return x * 2\n")
    assert pooled.grade({"solution.py": probe}, tests).passed  # the next grade found a clean sandbox
    assert not [p for p in Path(pooled._root).iterdir() if p.name != "grade_runner.py"]  # tests removed


def _kill_when(find, timeout=120.0) -> threading.Thread:
    """From a thread: kill the container ``find()`` names as soon as it names one."""
    def run():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            container = find()
            if container:
                docker_api().kill(container)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.docker
def test_a_killed_sandbox_fails_its_episode_and_is_dropped_from_training(docker, renderer, sandboxes):
    """Two episodes of one group, both writing the correct body; the sandbox of one is killed between
    its write and its run_tests. That episode fails (SandboxFailure, counted), has no sample, and the
    group trains on the other one alone; the pool replaces the dead sandbox."""
    pool, grader = sandboxes
    task = make_tasks(1, seed=5)[0]
    written = threading.Event()
    victim: dict = {}

    class Env(FunctionEnv):
        async def write(self, code):
            result = await FunctionEnv.write(self, code)
            if not victim:
                victim["container"] = (await self.sandbox()).container_id
                victim["env"] = self
                written.set()
                await asyncio.to_thread(killer.join, 30)  # run_tests comes after the container is gone
            return result

    killer = _kill_when(lambda: written.is_set() and victim["container"])
    policy = ScriptedPolicy(renderer.tokenizer, expert_replies(task))
    result = asyncio.run(generate_rollout(functools.partial(Env, pool=pool, grader=grader), [task], policy, renderer,
                                          n_samples_per_task=2, concurrency=2))
    failed = [e for e in result.episodes if e.metrics.error]
    assert len(failed) == 1 and failed[0].metrics.error.startswith("SandboxFailure")
    assert failed[0].samples == [] and victim["env"].grade is None  # never graded: no reward, not 0
    summary = result.summary()
    assert summary["failed"] == 1 and summary["failure_reasons"] == {"SandboxFailure": 1}
    assert summary["reward_mean"] == 1.0  # over the episode that has a reward
    kept = DataBuffer(lambda group: True).kept([[s for e in group for s in e.samples] for group in result.groups])
    assert [s.reward for group in kept for s in group] == [1.0]
    with pool.session() as fresh:  # the dead sandbox was replaced, the pool is whole
        assert fresh.healthy() and pool.idle_count == 1


@pytest.mark.docker
def test_a_grading_sandbox_killed_mid_grade_fails_the_episode(docker, renderer, sandboxes):
    pool, grader = sandboxes
    task = make_tasks(1, seed=6)[0]
    # Correct, and slow enough to kill: the killer polls `docker top` of every grading container, which
    # took longer than a 3 s window on a loaded CI machine; a kill ends the grade at once either way.
    body = "import time\ntime.sleep(20)\n" + oneliners.solution_body(task)

    def grading_container():
        """The grading container while the hidden tests run in it."""
        mine = {"label": ["agentrl.role=grader", "agentrl.example=coding_agent", f"agentrl.owner_pid={os.getpid()}"]}
        for container in docker_api().containers(filters=mine):
            processes = docker_api().top(container["Id"]).get("Processes") or []
            if any("grade_runner" in " ".join(p) for p in processes):  # ps cuts the command line
                return container["Id"]
        return None

    killer = _kill_when(grading_container)
    with pytest.raises(SandboxFailure, match="grading"):
        play(renderer, task, [call("write", code=body), call("submit")], sandboxes)
    killer.join(10)
    result, _ = play(renderer, task, expert_replies(task), sandboxes)  # the grader pool recovered
    assert result.metrics.reward == 1.0


@pytest.mark.docker
def test_episodes_waiting_for_a_grader_hold_no_agent_sandbox_and_no_worker_thread(docker, renderer, sandboxes):
    """The only grading sandbox is taken. Four episodes share the two agent sandboxes: all four write,
    run their tests and reach the grade (each gave its agent sandbox back before waiting), while the
    sandbox thread pool, two workers here, still runs other calls. Once the grading sandbox is back, every
    episode is graded."""
    from agentrl.sandbox import blocking

    pool, grader = sandboxes
    tasks = make_tasks(4, seed=9)
    scripts = {t["prompt"]: expert_replies(t) for t in tasks}
    policy = ScriptedPolicy(renderer.tokenizer, lambda prompt, turn: next(
        s for p, s in scripts.items() if p in prompt)[min(turn, 2)])
    tested = []

    class Env(FunctionEnv):
        async def run_tests(self):
            tested.append(await FunctionEnv.run_tests(self))
            return tested[-1]

    async def main():
        held = await grader.pool.aacquire()
        rollout = asyncio.ensure_future(generate_rollout(functools.partial(Env, pool=pool, grader=grader), tasks,
                                                         policy, renderer, concurrency=4))
        try:
            deadline = time.monotonic() + 120
            while len(tested) < 4:
                assert time.monotonic() < deadline and not rollout.done(), f"{len(tested)} of 4 ran their tests"
                await asyncio.sleep(0.05)
            assert await asyncio.wait_for(blocking.run_blocking(lambda: 42), 10) == 42
            assert not rollout.done()
        finally:
            await grader.pool.arelease(held)
        return await asyncio.wait_for(rollout, 120)

    workers = blocking._max_workers
    blocking.configure(2)
    try:
        result = asyncio.run(main())
    finally:
        blocking.configure(workers)
    assert [e.metrics.reward for e in result.episodes] == [1.0] * 4


@pytest.mark.docker
def test_rollout_metrics_count_real_sandbox_executions(docker, renderer, sandboxes):
    from examples.coding_agent import function_env

    pool, grader = sandboxes
    function_env.METER.report()  # start from zero
    tasks = make_tasks(4, seed=8)
    scripts = {t["prompt"]: expert_replies(t) for t in tasks}
    policy = ScriptedPolicy(renderer.tokenizer, lambda prompt, turn: next(
        s for p, s in scripts.items() if p in prompt)[min(turn, 2)])
    result = asyncio.run(generate_rollout(functools.partial(FunctionEnv, pool=pool, grader=grader), tasks, policy,
                                          renderer, concurrency=4))
    assert [e.metrics.reward for e in result.episodes] == [1.0] * 4
    out = FunctionEnv.rollout_metrics()
    assert out["sandbox/execs"] == 8 and out["sandbox/ops"] == 16  # run_tests + grade run each; writes, grades
    assert out["sandbox/execs_per_s"] > 0 and 0 < out["sandbox/exec_p50_ms"] <= out["sandbox/exec_p99_ms"]
    assert out["sandbox/failed_episodes"] == 0


@pytest.mark.docker
def test_containers_a_killed_run_left_are_removed_at_the_next_start(docker):
    from agentrl.sandbox import DockerSandbox
    from agentrl.sandbox.labels import OWNER_PID
    from examples.coding_agent.function_env import remove_orphans

    orphan = DockerSandbox(labels={**LABELS, OWNER_PID: "4194999"})  # above the largest pid: its owner is gone
    with DockerSandbox(labels=LABELS) as live:
        orphan.start()
        assert remove_orphans() >= 1
        mine = {"label": [f"agentrl.example={LABELS['agentrl.example']}"]}
        names = {n.lstrip("/") for c in docker_api().containers(all=True, filters=mine) for n in c["Names"]}
        assert orphan.name not in names and live.name in names  # a live owner's container stays
        assert not docker_api().volumes(filters={"name": orphan.volume_name}).get("Volumes")
    orphan.close()


# ---- the example, trained at toy size ----------------------------------------------------------------
@pytest.mark.docker
def test_the_example_trains_two_grpo_steps_and_leaves_no_container(docker, tmp_path):
    """``agentrl train examples/coding_agent/config.yaml`` for two GRPO steps at toy size: every reward
    from a sandbox execution (env/sandbox metrics in each step row), and after the run no container of
    this example is left on the engine."""
    from agentrl.run.cli import main
    from agentrl.sandbox.labels import owner_alive

    api = docker_api()
    label = {"label": [f"agentrl.example={LABELS['agentrl.example']}"]}
    before = {c["Id"] for c in api.containers(all=True, filters=label)}
    out = tmp_path / "run"
    small = ["--cache_dir", str(tmp_path / "cache"), "--steps", "2", "--warmup.max_steps", "4",
             "--warmup.check_every", "2", "--warmup.num_conversations", "16", "--warmup.batch_size", "8",
             "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
             "--rollout.max_new_tokens", "24", "--eval.every", "2", "--eval.num_tasks", "4"]
    assert main([str(CONFIG), "--output-dir", str(out), *small]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2] and "eval_accuracy" in steps[0] and "eval_accuracy" in steps[2]
    for row in steps[1:]:
        assert row["rollout/episodes"] == 4 and row["rollout/unproven_trained_tokens"] == 0
        assert row["env/sandbox/pool_size"] == FunctionEnv.pool_size
        assert row["env/sandbox/grader_pool_size"] == FunctionEnv.grader_pool_size
        # The grading pool always runs; agent sandboxes start with the first episode that writes.
        assert FunctionEnv.grader_pool_size <= row["env/sandbox/containers"] <= (
            FunctionEnv.pool_size + FunctionEnv.grader_pool_size)
        graded = row["rollout/episodes"] - row["rollout/failed"]
        assert graded > 0 and row["env/sandbox/execs"] >= graded  # every reward came from a grade
    # Ours are the new ones whose owner (the run's rollout process) has exited: none may be left.
    # (A new one whose owner still lives belongs to another run of this example on the same engine.)
    deadline = time.monotonic() + 30
    while True:
        new = [c for c in api.containers(all=True, filters=label) if c["Id"] not in before]
        if not any(owner_alive(c["Labels"]) for c in new) or time.monotonic() > deadline:
            break
        time.sleep(1)
    left = [c for c in new if not owner_alive(c["Labels"])]
    assert left == [], [c["Names"] for c in left]
