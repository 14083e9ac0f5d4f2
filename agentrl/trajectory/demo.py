"""The trajectory contract on a real multi-turn tool chat (tiny BPE tokenizer, ChatML template).

A scripted sampler plays "What is 12+73?" with a calculator and a submit tool. In the drifting
episode it splits "submit" as "sub" + "mit" — ids a model can sample, but not the canonical encoding
of that text — so when the chat template re-renders the history, the next prompt no longer extends
what was sampled. The demo records the clean and the drifting episode under each policy, verifies
every sample against the turn records, and dumps one sample token by token. No model runs here, so
the log-probs are placeholders; everything else is the real path (tokenizer, template, manager).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agentrl.trajectory import TrajectoryManager, TurnRecord, trained_turns, verify_session
from agentrl.trajectory.dump import format_sample

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "models" / "assets" / "tiny_tokenizer"

SYSTEM = {"role": "system", "content": "You add numbers. Use the calculator, then submit the answer."}
QUESTION = {"role": "user", "content": "What is 12+73?"}


def _call(name: str, **arguments) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


# (sampled text pieces, parsed response message, messages the environment appends)
CLEAN_EPISODE = [
    (
        ['<tool_call>{"name": "calculator", "arguments": {"expression": "12+73"}}</tool_call>'],
        _call("calculator", expression="12+73"),
        [{"role": "tool", "content": "85"}],
    ),
    (
        ['<tool_call>{"name": "submit", "arguments": {"answer": 85}}</tool_call>'],
        _call("submit", answer=85),
        [{"role": "tool", "content": "correct"}],
    ),
    (["The answer is 85."], {"role": "assistant", "content": "The answer is 85."}, []),
]
DRIFT_EPISODE = [
    CLEAN_EPISODE[0],
    (['<tool_call>{"name": "sub', 'mit", "arguments": {"answer": 85}}</tool_call>'], *CLEAN_EPISODE[1][1:]),
    CLEAN_EPISODE[2],
]


class ChatTokenizer:
    """A tokenizer directory through transformers: chat template to text, text to ids.

    ``run_demo`` only needs ``encode``, ``prompt_ids``, ``decode_one`` and ``eos_id``; any object with
    those works (the tests pass a faster one built on ``tokenizers`` + jinja2).
    """

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_id = self.hf.convert_tokens_to_ids("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def decode_one(self, token: int) -> str:
        return self.hf.decode([token], skip_special_tokens=False)


def play(manager: TrajectoryManager, tok: ChatTokenizer, session_id: str, episode) -> list[str]:
    """Run the scripted episode through the manager, the way the agent loop does; return the outcomes."""
    history, outcomes = [SYSTEM, QUESTION], []
    for k, (pieces, message, then) in enumerate(episode):
        prompt = tok.prompt_ids(history)
        output = [i for piece in pieces for i in tok.encode(piece)] + [tok.eos_id]
        logprobs = [round(-0.05 - ((3 * k + j) % 9) / 20, 4) for j in range(len(output))]
        turn = TurnRecord(prompt, output, logprobs, "stop", weight_version="0")
        outcomes.append(
            manager.record_turn(session_id, turn=turn, prompt_messages=history, response_message=message)
        )
        history = [*history, message, *then]
    return outcomes


def run(tok: ChatTokenizer, policy: str, episode, threshold: int = 1024):
    manager = TrajectoryManager(policy=policy, fork_threshold_tokens=threshold)
    outcomes = play(manager, tok, "episode", episode)
    records = manager.turns("episode")
    samples = manager.get_trajectory("episode", reward=1.0, group_id="12+73")
    verify_session(samples, records)  # raises ProvenanceError if any invariant broke
    return outcomes, samples, records


def run_demo(tok: ChatTokenizer) -> tuple[str, list]:
    """Play every episode x policy; return the printed report and the drifting episode's realign samples."""
    lines = []
    rows = [("clean episode", "realign", CLEAN_EPISODE, 1024)]
    rows += [("drifting episode", policy, DRIFT_EPISODE, 1024) for policy in ("realign", "fork", "truncate")]
    rows.append(("drifting episode", "realign", DRIFT_EPISODE, 4))
    lines.append(
        f"{'episode':<17} {'policy':<9} {'threshold':>9}  {'outcomes per turn':<34} samples  "
        "trained turns   trained/sampled tokens"
    )
    kept: list = []
    for name, policy, episode, threshold in rows:
        outcomes, samples, records = run(tok, policy, episode, threshold)
        trained = [sorted(trained_turns(s)) for s in samples]
        n_trained = sum(sum(s.loss_mask) for s in samples)
        sampled = sum(len(r.output_ids) for r in records)
        lines.append(
            f"{name:<17} {policy:<9} {threshold:>9}  {', '.join(outcomes):<34} {len(samples):>7}  "
            f"{str(trained):<15} {n_trained}/{sampled}"
        )
        if name == "drifting episode" and policy == "realign" and threshold == 1024:
            kept = samples
    lines.append(
        "\nEvery sample above passed verify(): each trained token is a sampled token at its sampled position,"
        "\nwith its sampled log-prob, after exactly the tokens the engine saw; nothing else is trained.\n"
    )
    lines.append("The drifting episode under policy=realign, token by token:\n")
    lines.append(format_sample(0, kept[0], tok.decode_one))
    return "\n".join(lines), kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m agentrl.trajectory.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--tokenizer", default=str(TOKENIZER_DIR), help="tokenizer directory with a chat template"
    )
    parser.add_argument(
        "--out", help="also write the realign samples as JSON lines (read them with `agentrl dump`)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tok = ChatTokenizer(Path(args.tokenizer))
    print(f"tokenizer: {args.tokenizer} (vocab {len(tok.hf)}, via transformers)\n")
    report, kept = run_demo(tok)
    print(report)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(s.to_dict()) + "\n" for s in kept), encoding="utf-8")
        print(f"\nwrote {args.out}; inspect it with: agentrl dump {args.out} --tokenizer {args.tokenizer}")
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
