"""What the coding tools tell the model: the visible-example runner (run inside the sandbox) and the exact
texts of tool results. The expert chat uses the same functions, so a scripted expert episode reproduces
its tool messages token for token."""

from __future__ import annotations

import json
from typing import Any

from agentrl.sandbox.result import ExecResult

SOLUTION_FILE = "solution.py"
MAX_STREAM_CHARS = 1500

# Runs in the agent's sandbox: imports solution.py and checks each example; prints one line per example
# and a summary. Floats compare with a tolerance (docstrings round them). Example values are Python
# expressions, evaluated with nothing but builtins.
RUNNER = r'''
import json, math, sys
sys.path.insert(0, ".")
examples = json.loads(sys.stdin.read())
def same(a, b):
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
        except TypeError:
            return False
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b
try:
    import solution
except BaseException as exc:
    print(f"solution.py failed to import: {type(exc).__name__}: {exc}")
    raise SystemExit(0)
passed = 0
for ex in examples:
    try:
        got = eval(ex["call"], dict(vars(solution)))
    except BaseException as exc:
        print(f"FAIL {ex['call']}: raised {type(exc).__name__}: {exc}")
        continue
    want = eval(ex["expected"], {})
    if same(got, want):
        passed += 1
        print(f"ok   {ex['call']} == {ex['expected']}")
    else:
        print(f"FAIL {ex['call']}: returned {got!r}, expected {ex['expected']}")
print(f"{passed}/{len(examples)} examples passed")
'''


def runner_input(examples: list[dict[str, str]]) -> str:
    return json.dumps(examples)


def all_passed_report(examples: list[dict[str, str]]) -> str:
    """The run_tests result when every example passes (what the expert's run_tests call returns)."""
    if not examples:
        return NO_EXAMPLES
    lines = [f"ok   {ex['call']} == {ex['expected']}" for ex in examples]
    return "\n".join([*lines, f"{len(examples)}/{len(examples)} examples passed"])


NO_EXAMPLES = "This task shows no examples to run; test your function with run_python."
NO_SOLUTION = f"{SOLUTION_FILE} does not exist yet: write it with write_file first."


def wrote_message(path: str, content: str) -> str:
    return f"wrote {path} ({len(content.encode())} bytes)"


def _clip(text: str) -> str:
    if len(text) <= MAX_STREAM_CHARS:
        return text
    return text[:MAX_STREAM_CHARS] + f"\n[... {len(text) - MAX_STREAM_CHARS} more characters]"


def exec_report(res: ExecResult, timeout_s: float) -> str:
    """A command's outcome as the model reads it: status line, then stdout and stderr (clipped)."""
    if res.timed_out:
        status = f"timed out after {timeout_s:g} s"
    elif res.oom_killed:
        status = "killed: out of memory"
    else:
        status = f"exit code {res.exit_code}"
    parts = [status]
    if res.stdout:
        parts.append("stdout:\n" + _clip(res.stdout.rstrip("\n")))
    if res.stderr:
        parts.append("stderr:\n" + _clip(res.stderr.rstrip("\n")))
    return "\n".join(parts)


def examples_report(res: ExecResult, timeout_s: float) -> str:
    """The run_tests result: the runner's lines, or what went wrong running it."""
    if res.ok and res.stdout.strip():
        return _clip(res.stdout.rstrip("\n"))
    return exec_report(res, timeout_s)


def describe(task: dict[str, Any]) -> str:
    """The user message of a task."""
    return (f"Implement `{task['entry_point']}` below. Save the complete module (signature and body) to "
            f"{SOLUTION_FILE}.\n\n```python\n{task['prompt']}```")
