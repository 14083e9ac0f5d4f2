"""The arithmetic tool task for a pretrained chat model whose template shows no tools: SmolLM2-135M-Instruct.

SmolLM2's chat template drops the ``tools`` argument, so the model never sees a tool schema, and zero-shot
it answers in prose (no ``<tool_call>`` in 8 samples at T=1, measured on CPU). :class:`FewShotArithmeticToolEnv`
starts every episode with worked episodes as earlier turns of the same chat: the expert chats
(:func:`agentrl.envs.arithmetic.expert_messages`) of :data:`DEMONSTRATIONS`, sums of one-digit numbers, so
no demonstration is ever a task (tasks add 10..99). They are prompt tokens: never trained, never scored.
Measured with two of them on the pretrained model (HF generate, CPU, 3 questions x 16 samples): the first
reply is the right ``add`` call in 3/3 greedy and, with plain temperature sampling (what the engines do), in
44/48 samples at T=0.5 and 36/48 at T=0.7; at T=1 the engine's replies are mostly malformed (0 of 8
episodes scored in a CPU smoke run), so the GPU config samples at 0.7.
Reward and tools are :class:`~agentrl.envs.arithmetic.ArithmeticToolEnv`'s: ``add``, then ``submit``.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.arithmetic import ArithmeticToolEnv, expert_messages

DEMONSTRATIONS: tuple[tuple[int, int], ...] = ((3, 4), (6, 8))


def demonstration_messages(pairs: tuple[tuple[int, int], ...] = DEMONSTRATIONS) -> list[dict[str, Any]]:
    """The user / assistant / tool turns of the expert episodes adding ``pairs`` (no system message)."""
    turns: list[dict[str, Any]] = []
    for a, b in pairs:
        chat = expert_messages({"a": a, "b": b, "answer": a + b, "multi_turn": True})
        turns += [m for m in chat if m["role"] != "system"]
    return turns


class FewShotArithmeticToolEnv(ArithmeticToolEnv):
    """:class:`ArithmeticToolEnv` with :data:`DEMONSTRATIONS` played out between the system prompt and the
    question."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        system, question = super().reset(task)
        return [system, *demonstration_messages(), question]
