"""Search-R1 example: corpus, BM25 search, questions and splits, reward, and scripted episodes whose
Samples pass verify with tool tokens never trained."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("countryinfo")
pytest.importorskip("bm25s")

from agentrl.envs import generate_rollout  # noqa: E402
from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.trajectory import verify_session  # noqa: E402
from examples.search_r1.corpus import build_corpus, countries, documents_of  # noqa: E402
from examples.search_r1.env import SearchR1Env, default_index, expert_replies  # noqa: E402
from examples.search_r1.questions import KINDS, all_questions, held_out_countries, make_questions  # noqa: E402
from examples.search_r1.reward import exact_match, extract_answer, f1, normalize_answer, score  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"


@pytest.fixture(scope="module")
def renderer():
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))


def test_corpus_has_one_document_per_country_and_field():
    docs = build_corpus()
    pairs = Counter((d.country, d.field) for d in docs)
    assert max(pairs.values()) == 1 and len(docs) > 1000
    assert {d.field for d in docs} >= {"capital", "population", "area", "borders", "region"}
    described = {c.name for c in countries() if documents_of(c)}  # two entries of countryinfo have no facts
    assert {d.country for d in docs} == described and len(described) > 200
    assert [d.id for d in docs] == list(range(len(docs)))
    france = {d.field: d.text for d in docs if d.country == "France"}
    assert france["capital"] == "The capital of France is Paris."


def test_search_ranks_the_document_of_the_named_country_first():
    index = default_index()
    assert index.search("capital of Ethiopia")[0].text == "The capital of Ethiopia is Addis Ababa."
    assert index.search("population of Japan", k=1)[0].field == "population"
    assert index.search("zzzz qqqq") == [] and index.search("") == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search("France", k=0)


def test_questions_are_deterministic_disjoint_by_country_and_correct():
    qs = all_questions()
    assert {q["kind"] for q in qs} == set(KINDS)
    assert make_questions(20, seed=3) == make_questions(20, seed=3) != make_questions(20, seed=4)
    train, held = make_questions(split="train"), make_questions(split="heldout")
    assert {q["country"] for q in train}.isdisjoint({q["country"] for q in held})
    assert {q["country"] for q in held} <= held_out_countries() and len(held) > 50
    by_name = {c.name: c for c in countries()}
    for q in qs:
        c = by_name[q["country"]]
        if q["kind"] == "capital":
            assert q["answers"] == [c.capital]
        elif q["kind"] == "population_by_capital":
            assert q["answers"] == [str(c.population)] and c.capital in q["question"]
        else:
            areas = {n: by_name[n].area or 0 for n in c.borders}
            assert q["answers"] == [max(areas, key=areas.get)]
    with pytest.raises(ValueError, match="split"):
        make_questions(split="test")
    with pytest.raises(ValueError, match="unknown question kinds"):
        make_questions(kinds=("nope",))


def test_reward_exact_match_f1_and_format():
    assert normalize_answer("The  Addis-Ababa!") == "addisababa"
    assert extract_answer("I think <answer> Paris </answer>") == "Paris"
    assert extract_answer("<answer>a</answer><answer>b</answer>") is None
    assert exact_match("the paris", ["Paris"]) == 1.0 and exact_match("Lyon", ["Paris"]) == 0.0
    assert f1("Addis", ["Addis Ababa"]) == pytest.approx(2 / 3)
    assert score("<answer>Paris</answer>", ["Paris"]) == 1.0
    assert score("<answer>Lyon</answer>", ["Paris"]) == pytest.approx(0.2)  # format only
    assert score("Paris", ["Paris"]) == 0.0  # no answer tag: nothing
    assert score("<answer>Addis</answer>", ["Addis Ababa"], metric="f1") == pytest.approx(0.2 + 0.8 * 2 / 3)
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], metric="bleu")


def test_scripted_episodes_verify_and_never_train_tool_tokens(renderer):
    tokenizer = renderer.tokenizer
    tasks = [next(q for q in make_questions(kinds=(kind,), seed=1) if len(q["queries"]) <= 3) for kind in KINDS]
    scripts = {t["question"]: expert_replies(t) for t in tasks}

    def reply(prompt_text, turn):
        question = next(q for q in scripts if q in prompt_text)
        return scripts[question][turn]

    policy = ScriptedPolicy(tokenizer, reply)
    result = asyncio.run(generate_rollout(SearchR1Env, tasks, policy, renderer, n_samples_per_task=2))
    assert result.summary()["failed"] == 0
    for group, task in zip(result.groups, tasks, strict=True):
        assert len({e.group_id for e in group}) == 1
        for episode in group:
            m = episode.metrics
            assert m.reward == 1.0 and m.stop_reason == "no_tool_call"
            assert m.tool_calls == len(task["queries"]) and m.ill_formed_turns == 0
            turns = policy.turns[episode.session_id]
            verify_session(episode.samples, turns)
            [sample] = episode.samples
            assert sample.reward == 1.0 and sample.group_id == episode.group_id
            response = sample.tokens[sample.response_start:]
            for mask, prov in zip(sample.loss_mask, sample.provenance[sample.response_start:], strict=True):
                assert not mask or prov.source == "model"
            untrained = tokenizer.decode([t for t, mk in zip(response, sample.loss_mask, strict=True) if not mk])
            trained = tokenizer.decode([t for t, mk in zip(response, sample.loss_mask, strict=True) if mk])
            assert "<tool_response>" in untrained and "<tool_response>" not in trained
            first_result = next(msg["content"] for msg in episode.messages if msg["role"] == "tool")
            assert first_result in untrained and first_result not in trained


def test_wrong_or_missing_answer_scores_low(renderer):
    task = make_questions(1, kinds=("capital",), seed=2)[0]
    for final, expected in [("<answer>Atlantis</answer>", 0.2), ("I do not know.", 0.0)]:
        policy = ScriptedPolicy(renderer.tokenizer, [final])
        result = asyncio.run(generate_rollout(SearchR1Env, [task], policy, renderer))
        [episode] = result.episodes
        assert episode.metrics.reward == pytest.approx(expected) and episode.metrics.turns == 1


def test_run_script_with_the_expert_policy_writes_samples(tmp_path, capsys):
    import json

    from agentrl.trajectory import Sample
    from examples.search_r1.run import main

    out = tmp_path / "samples.jsonl"
    assert main(["--scripted", "--model", str(TOKENIZER_DIR), "--n", "4", "--samples", "2",
                 "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["episodes"] == 8 and summary["failed"] == 0
    samples = [Sample.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    assert len(samples) == 8 and all(s.trained_tokens > 0 for s in samples)
    assert len({s.group_id for s in samples}) == 4


def test_run_script_needs_a_policy():
    from examples.search_r1.run import main

    with pytest.raises(SystemExit):
        main(["--model", str(TOKENIZER_DIR)])
