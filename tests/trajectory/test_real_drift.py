"""Real re-tokenization drift: a real BPE + chat template re-render what was sampled differently.

Each scenario plays a scripted episode: the "sampler" emits text pieces that are encoded piece by piece
(an id sequence a model can sample, but not the canonical encoding of its text), the agent parses the
response into a chat message, and the next prompt is the template re-rendering of the history. We
assert the drift really happens where the scenario says, and what each policy does with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from real_tokenizers import ChatTokenizer, qwen_tokenizer, tiny_tokenizer

from agentrl.trajectory import (
    TrajectoryManager,
    TurnRecord,
    common_prefix_length,
    trained_turns,
    verify_session,
)


@pytest.fixture(scope="module", params=["tiny", "qwen"])
def tok(request) -> ChatTokenizer:
    if request.param == "tiny":
        return tiny_tokenizer()
    try:
        return qwen_tokenizer()
    except (ImportError, FileNotFoundError, ValueError) as exc:  # package or tiktoken missing
        pytest.skip(f"Qwen2.5 vocabulary unavailable: {exc}")


@dataclass
class ModelTurn:
    pieces: list[str]  # sampled text, encoded piece by piece
    message: dict  # the response message the agent parsed
    then: list[dict] = field(default_factory=list)  # messages the environment appends
    finish: str = "stop"  # "length": no end-of-turn token was sampled


def tool_call(name: str, **arguments) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


SYSTEM = {"role": "system", "content": "You add numbers. Use the calculator, then submit."}
QUESTION = {"role": "user", "content": "What is 12+73?"}


def play(
    tok: ChatTokenizer, turns: list[ModelTurn], policy: str, threshold: int = 1024, start=(SYSTEM, QUESTION)
):
    """Run the episode; return (outcomes, samples, records, held-before-each-turn, prompts)."""
    manager = TrajectoryManager(policy=policy, fork_threshold_tokens=threshold)
    history, outcomes, prompts = list(start), [], []
    for k, mt in enumerate(turns):
        prompt = tok.prompt_ids(history)
        output = [i for piece in mt.pieces for i in tok.encode(piece)] + (
            [tok.eos_id] if mt.finish == "stop" else []
        )
        logprobs = [-0.05 - ((k + j) % 7) / 10 for j in range(len(output))]
        record = TurnRecord(prompt, output, logprobs, mt.finish, weight_version="v1")
        outcomes.append(
            manager.record_turn("ep", turn=record, prompt_messages=history, response_message=mt.message)
        )
        prompts.append(prompt)
        history = [*history, mt.message, *mt.then]
    records = manager.turns("ep")
    samples = manager.get_trajectory("ep", reward=1.0)
    verify_session(samples, records)
    return outcomes, samples, records


def divergence(records, k: int) -> int:
    """Where turn k's prompt leaves turn k-1's prompt + output (== held length when clean)."""
    held = records[k - 1].prompt_ids + records[k - 1].output_ids
    return common_prefix_length(held, records[k].prompt_ids)


def trained(samples) -> list[list[int]]:
    return [sorted(trained_turns(s)) for s in samples]


# --- scenarios -----------------------------------------------------------------------------------


def compact_json_tool_call() -> list[ModelTurn]:
    """The model writes compact JSON; the template re-serialises the parsed call with spaces."""
    return [
        ModelTurn(
            ['<tool_call>{"name":"calculator","arguments":{"expression":"12+73"}}</tool_call>'],
            tool_call("calculator", expression="12+73"),
            then=[{"role": "tool", "content": "85"}],
        ),
        ModelTurn(
            ['<tool_call>{"name": "submit", "arguments": {"answer": 85}}</tool_call>'],
            tool_call("submit", answer=85),
        ),
    ]


def mid_word_split() -> list[ModelTurn]:
    """The sampler split "submit" as "sub" + "mit": same text, non-canonical ids."""
    return [
        ModelTurn(
            ['<tool_call>{"name": "sub', 'mit", "arguments": {"answer": 85}}</tool_call>'],
            tool_call("submit", answer=85),
            then=[{"role": "tool", "content": "correct"}],
        ),
        ModelTurn(["Done."], {"role": "assistant", "content": "Done."}),
    ]


def blank_line_split() -> list[ModelTurn]:
    """'85.\\n' then '\\nNext': two newline tokens where BPE has one '\\n\\n' token."""
    text = ["The sum is 85.\n", "\nNext I will check it."]
    return [
        ModelTurn(
            text,
            {"role": "assistant", "content": "".join(text)},
            then=[{"role": "user", "content": "Go on."}],
        ),
        ModelTurn(["Checked: 85."], {"role": "assistant", "content": "Checked: 85."}),
    ]


def stripped_trailing_space() -> list[ModelTurn]:
    """A length-cut response ends in a space; the agent strips the content before re-rendering it."""
    return [
        ModelTurn(
            ["Let me compute the "],
            {"role": "assistant", "content": "Let me compute the"},
            then=[{"role": "user", "content": "Continue."}],
            finish="length",
        ),
        ModelTurn(["sum: 85."], {"role": "assistant", "content": "sum: 85."}),
    ]


def kept_trailing_space() -> list[ModelTurn]:
    """The same length-cut response re-rendered verbatim: the control token splits it, no drift."""
    turns = stripped_trailing_space()
    turns[0].message = {"role": "assistant", "content": "Let me compute the "}
    return turns


def canonical_tool_chat() -> list[ModelTurn]:
    """Canonically tokenized outputs split at message boundaries: never drifts."""
    return [
        ModelTurn(
            ['<tool_call>{"name": "calculator", "arguments": {"expression": "12+73"}}</tool_call>'],
            tool_call("calculator", expression="12+73"),
            then=[{"role": "tool", "content": "85"}],
        ),
        ModelTurn(
            ['<tool_call>{"name": "submit", "arguments": {"answer": 85}}</tool_call>'],
            tool_call("submit", answer=85),
            then=[{"role": "tool", "content": "correct"}],
        ),
        ModelTurn(["Done."], {"role": "assistant", "content": "Done."}),
    ]


LATEST_RESPONSE_DRIFTS = {
    "compact-json": compact_json_tool_call,
    "mid-word": mid_word_split,
    "blank-line": blank_line_split,
    "stripped-space": stripped_trailing_space,
}


@pytest.mark.parametrize("scenario", sorted(LATEST_RESPONSE_DRIFTS))
def test_drift_inside_the_latest_response_per_policy(tok, scenario):
    turns = LATEST_RESPONSE_DRIFTS[scenario]()
    outcomes, samples, records = play(tok, turns, "realign")
    # The drift is real and lies inside turn 0's response.
    d = divergence(records, 1)
    start, held = len(records[0].prompt_ids), len(records[0].prompt_ids) + len(records[0].output_ids)
    assert start <= d < held, (tok.name, scenario, d, start, held)
    # Cause: either the sampled ids are not the canonical encoding of their own text (mid-word,
    # blank-line), or the re-rendered message is not the sampled text (compact-json, stripped-space).
    text = "".join(turns[0].pieces)
    non_canonical = tok.encode(text) != [i for i in records[0].output_ids if i != tok.eos_id]
    rewritten = text not in tok.decode(list(records[1].prompt_ids))
    assert non_canonical != rewritten, (non_canonical, rewritten)
    drifted = held - d

    assert outcomes == ["new", "realigned"]
    assert trained(samples) == [[1]]  # the realigned response is not trained, the rest is
    (s,) = samples
    assert s.metadata["drift_points"] == [{"turn": 1, "position": d, "outcome": "realigned"}]
    assert s.tokens[: len(records[1].prompt_ids)] == list(records[1].prompt_ids)

    outcomes, samples, _ = play(tok, turns, "realign", threshold=drifted - 1)
    assert outcomes == ["new", "forked"] and trained(samples) == [[0], [1]]

    outcomes, samples, _ = play(tok, turns, "fork")
    assert outcomes == ["new", "forked"] and trained(samples) == [[0], [1]]
    assert sum(map(sum, (s.loss_mask for s in samples))) == sum(len(r.output_ids) for r in records)

    outcomes, samples, _ = play(tok, turns, "truncate")
    assert outcomes == ["new", "cut"] and trained(samples) == [[1]]


@pytest.mark.parametrize(
    "scenario", [canonical_tool_chat, kept_trailing_space], ids=["canonical", "kept-space"]
)
@pytest.mark.parametrize("policy", ["realign", "fork", "truncate"])
def test_exact_extensions_stay_one_fully_trained_sample(tok, scenario, policy):
    turns = scenario()
    outcomes, samples, records = play(tok, turns, policy)
    assert outcomes == ["new"] + ["clean"] * (len(turns) - 1)
    assert trained(samples) == [list(range(len(turns)))]
    assert sum(samples[0].loss_mask) == sum(len(r.output_ids) for r in records)


# Qwen3-style templates drop the reasoning of assistant turns before the last user message, so a
# new user message re-renders *earlier* responses differently.
REASONING_TEMPLATE = """
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content and loop.index0 > ns.last_query %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def reasoning_turns() -> list[ModelTurn]:
    def thought(reasoning, content, then):
        text = f"<think>\n{reasoning}\n</think>\n\n{content}"
        return ModelTurn(
            [text], {"role": "assistant", "content": content, "reasoning_content": reasoning}, then=then
        )

    return [
        thought("I should use the calculator.", "calculator(12+73)", [{"role": "tool", "content": "85"}]),
        thought("The tool says 85.", "The answer is 85.", [{"role": "user", "content": "And 85+1?"}]),
        thought("One more.", "86.", []),
    ]


def test_reasoning_dropped_from_earlier_turns_drifts_inside_an_earlier_response(tok):
    reasoning_tok = ChatTokenizer(tok.name, tok.encode, tok.decode, tok.eos_id, REASONING_TEMPLATE)
    turns = reasoning_turns()
    outcomes, samples, records = play(reasoning_tok, turns, "realign")
    d = divergence(records, 2)
    turn0_output = len(records[0].prompt_ids)
    # The <think> block opens turn 0's output, so the re-render leaves it at its first token: inside
    # an earlier response (turn 0), not the latest one (turn 1).
    assert turn0_output <= d < turn0_output + len(records[0].output_ids)
    assert outcomes == ["new", "clean", "forked"] and trained(samples) == [[0, 1], [2]]

    outcomes, samples, _ = play(reasoning_tok, turns, "fork")
    assert outcomes == ["new", "clean", "forked"] and trained(samples) == [[0, 1], [2]]

    outcomes, samples, _ = play(reasoning_tok, turns, "truncate")
    assert outcomes == ["new", "clean", "cut"] and trained(samples) == [[2]]
    (s,) = samples
    assert s.metadata["untrained_turns"] == [
        0,
        1,
    ]  # both outputs lie after the cut: replaced by the re-render


@pytest.mark.parametrize("policy", ["realign", "fork", "truncate"])
def test_a_summarised_history_branches_for_every_policy(tok, policy):
    turns = canonical_tool_chat()
    manager = TrajectoryManager(policy=policy)
    history = [SYSTEM, QUESTION]
    for mt in turns[:2]:
        prompt = tok.prompt_ids(history)
        out = tok.encode(mt.pieces[0]) + [tok.eos_id]
        manager.record_turn(
            "ep",
            turn=TurnRecord(prompt, out, [-0.1] * len(out), "stop"),
            prompt_messages=history,
            response_message=mt.message,
        )
        history = [*history, mt.message, *mt.then]
    summary = [
        SYSTEM,
        {"role": "user", "content": "Earlier: 12+73 was computed as 85 and submitted. Say done."},
    ]
    prompt = tok.prompt_ids(summary)
    out = tok.encode("Done.") + [tok.eos_id]
    assert (
        manager.record_turn(
            "ep",
            turn=TurnRecord(prompt, out, [-0.2] * len(out), "stop"),
            prompt_messages=summary,
            response_message={"role": "assistant", "content": "Done."},
        )
        == "branched"
    )
    records = manager.turns("ep")
    samples = manager.get_trajectory("ep")
    verify_session(samples, records)
    assert trained(samples) == [[0, 1], [2]]
