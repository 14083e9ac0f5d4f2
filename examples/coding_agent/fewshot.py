"""The coding agent (:class:`~examples.coding_agent.function_env.FunctionEnv`) for a pretrained chat model
whose template shows no tools: SmolLM2-135M-Instruct (``config_smollm2_gpu.yaml``).

SmolLM2's chat template drops the ``tools`` argument, so the model never sees the tool schemas.
:class:`FewShotFunctionEnv` plays :data:`DEMONSTRATIONS` worked episodes between the system prompt and the
task, as earlier turns of the same chat: the expert chats (:func:`expert_messages`, with the tool results
the environment gives) of tasks from the one-liner family's ``warmup`` split, whose specs GRPO's ``train``
and ``heldout`` splits never hold, so no demonstration is ever a task, with the ``run_tests`` turn left
out (write, then submit; ``run_tests`` stays available). They are prompt tokens: never trained, never
scored. Same pattern as ``examples/arithmetic/fewshot.py``.

Measured on the pretrained model (HF generate, CPU, 8 train tasks x 4 samples at T=0.7, first reply):
with the whole expert chats as demonstrations the first reply was ``run_tests`` in 22 of 24 samples
(``write`` in 2); without their ``run_tests`` turn it was ``write`` in 19/32, and 3/32 bodies passed the
task's visible example.

:class:`FewShotBwrapFunctionEnv` is the same environment in bubblewrap sandboxes
(``sandbox_backend = "bwrap"``), for a machine without Docker (the H200 device).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from examples.coding_agent.function_env import FunctionEnv, expert_messages, make_tasks

# Indices into make_tasks(12, seed=0, split="warmup"): a list map ("each item of h times two"), two
# arguments ("s plus g") and a slice ("the last two items of p"): three body shapes, three names.
DEMONSTRATIONS: tuple[int, ...] = (2, 10, 7)


@cache
def _demonstration_turns() -> tuple[dict[str, Any], ...]:
    tasks = make_tasks(12, seed=0, split="warmup")
    turns: list[dict[str, Any]] = []
    for i in DEMONSTRATIONS:
        chat = [m for m in expert_messages(tasks[i]) if m["role"] != "system"]
        # user, write, "saved", run_tests, report, submit, "submitted": keep all but the run_tests pair
        assert [m.get("name") for m in chat[3:5]] == [None, "run_tests"], chat
        turns += chat[:3] + chat[5:]
    return tuple(turns)


def demonstration_messages() -> list[dict[str, Any]]:
    """The user / assistant / tool turns of the worked episodes (no system message), fresh copies."""
    return [dict(m) for m in _demonstration_turns()]


class FewShotFunctionEnv(FunctionEnv):
    """:class:`FunctionEnv` with :data:`DEMONSTRATIONS` played out between the system prompt and the task."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        system, question = super().reset(task)
        return [system, *demonstration_messages(), question]


class FewShotBwrapFunctionEnv(FewShotFunctionEnv):
    """:class:`FewShotFunctionEnv` in bubblewrap sandboxes (agent pool and grader): no Docker needed."""

    sandbox_backend = "bwrap"
    # All of a step's episodes in flight at once (config_smollm2_gpu.yaml: concurrency 128), each holding its
    # sandbox from the first write to the episode's end; a bubblewrap sandbox is one idle Python process.
    pool_size = 128
    grader_pool_size = 16
