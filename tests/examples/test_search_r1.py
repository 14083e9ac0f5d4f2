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
from examples.search_r1.env import SearchR1Env, clip, default_index, expert_messages, expert_replies  # noqa: E402
from examples.search_r1.questions import (  # noqa: E402
    HOPS,
    KINDS,
    all_questions,
    held_out_countries,
    held_out_question_ids,
    make_questions,
)
from examples.search_r1.reward import exact_match, extract_answer, f1, normalize_answer, score  # noqa: E402

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
CONFIG = Path(__file__).resolve().parents[2] / "examples" / "search_r1" / "config.yaml"


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
    # China's long list of neighbours is the one naming both: length normalisation must not bury it.
    assert index.search("borders Afghanistan and Mongolia", k=1)[0].text.startswith("China borders ")
    assert index.search("zzzz qqqq") == [] and index.search("") == []
    with pytest.raises(ValueError, match="k must be >= 1"):
        index.search("France", k=0)


def test_search_results_are_clipped_numbered_and_at_most_top_k():
    env = SearchR1Env()
    lines = env.search("borders Afghanistan and Mongolia").splitlines()
    assert len(lines) == env.top_k == 2 and [line[:4] for line in lines] == ["[1] ", "[2] "]
    assert lines[0].startswith("[1] China borders Afghanistan,") and lines[0].endswith("...")
    assert all(len(line) <= 4 + env.snippet_chars for line in lines)
    assert env.search("zzzz") == "No results." and env.searches == ["borders Afghanistan and Mongolia", "zzzz"]
    assert clip("short", 10) == "short" and clip("one two three four", 12) == "one two..."
    assert clip("Aa, Bb, Cc, Dd", 12) == "Aa, Bb..."  # cut at a word, no dangling comma


def test_questions_are_deterministic_disjoint_by_country_and_correct():
    qs = all_questions()
    assert {q["kind"] for q in qs} == set(KINDS) and set(HOPS) == set(KINDS)
    assert make_questions(20, seed=3) == make_questions(20, seed=3) != make_questions(20, seed=4)
    train, held = make_questions(split="train"), make_questions(split="heldout")
    assert {q["country"] for q in train}.isdisjoint({q["country"] for q in held})
    assert {q["country"] for q in held} <= held_out_countries() and len(held) > 150
    by_name = {c.name: c for c in countries()}
    capitals = Counter(c.capital for c in countries())
    for q in qs:
        c = by_name[q["country"]]
        assert len(q["queries"]) == HOPS[q["kind"]] == len(q["evidence"])
        if q["kind"] == "capital":
            assert q["answers"] == [c.capital] and c.name in q["question"]
        elif q["kind"] == "country_of_capital":
            assert q["answers"] == [c.name] and capitals[c.capital] == 1 and c.capital in q["question"]
        elif q["kind"] == "population_by_capital":
            assert q["answers"] == [str(c.population)] and c.capital in q["question"]
        else:
            x, y = q["id"].removeprefix("neighbour_capital:").split("+")
            assert f"borders {x} and {y}?" in q["question"] and q["answers"] == [c.capital]
            common = set(by_name[x].borders) & set(by_name[y].borders)
            assert common == {c.name}  # exactly one country borders both: one answer


def test_the_question_holdout_splits_questions_not_countries():
    train = make_questions(split="train", holdout="question")
    held = make_questions(split="heldout", holdout="question")
    assert {q["id"] for q in train}.isdisjoint({q["id"] for q in held})
    assert len(train) + len(held) == len(all_questions())
    for kind in KINDS:
        n_held = sum(q["kind"] == kind for q in held)
        total = sum(q["kind"] == kind for q in all_questions())
        assert n_held == int(total * 0.2)  # HELD_OUT_FRACTION of every kind
    trained_countries = {q["country"] for q in train}
    assert sum(q["country"] in trained_countries for q in held) > len(held) / 2  # new combinations
    with pytest.raises(ValueError, match="holdout"):
        make_questions(holdout="nope")


def test_the_warmup_share_keeps_warmup_grpo_and_heldout_questions_apart():
    """The run's warm-up reads the "warmup" split (FunctionTasks honours make_questions.warmup_split), GRPO
    the "train" split: with warmup_share they never share a question, and held-out shares neither."""
    import yaml

    from agentrl.run.data import FunctionTasks

    kwargs = yaml.safe_load(CONFIG.read_text())["task_kwargs"]
    assert kwargs["holdout"] == "question" and kwargs["warmup_share"] == 0.75  # the config's split is this one
    pools = {split: {q["id"] for q in make_questions(split=split, **kwargs)} for split in ("train", "warmup", "heldout")}
    assert pools["train"].isdisjoint(pools["warmup"]) and pools["heldout"].isdisjoint(pools["train"] | pools["warmup"])
    assert pools["warmup"].isdisjoint(held_out_question_ids())  # nor a held-out question of a warm-up-only kind
    for kind in kwargs["kinds"]:  # 3/4 of each GRPO kind's non-held-out questions (rounded)
        n = {s: sum(i.startswith(f"{kind}:") for i in ids) for s, ids in pools.items()}
        assert abs(n["warmup"] - 3 * n["train"]) <= 4
    only_warmup = set(kwargs["warmup_kinds"]) - set(kwargs["kinds"])
    assert only_warmup and {i.split(":")[0] for i in pools["heldout"] | pools["train"]} == set(kwargs["kinds"])
    for kind in only_warmup:  # every non-held-out question of a warm-up-only kind
        assert sum(i.startswith(f"{kind}:") for i in pools["warmup"]) == sum(
            q["kind"] == kind for q in make_questions(split="train", holdout="question"))
    real = {k: v for k, v in kwargs.items() if not k.endswith("_synthetic")}  # made-up questions are new ones
    tasks = FunctionTasks(make_questions, seed=0, task_kwargs=real)
    assert {q["id"] for q in tasks.warmup(1300, seed=1)} == pools["warmup"]  # 4 x 325 > each kind: all of it
    assert {q["id"] for step in range(1, 6) for q in tasks.train(64, step)} <= pools["train"]
    tasks = FunctionTasks(make_questions, seed=0, task_kwargs=kwargs)
    for drawn, pool in ((tasks.warmup(1300, seed=1), pools["warmup"]),
                        ([q for step in range(1, 6) for q in tasks.train(64, step)], pools["train"])):
        assert all(q["id"] in pool or q["id"].startswith("synthetic-") for q in drawn)
    assert {q["id"] for q in tasks.heldout(100)} <= pools["heldout"]
    # Without warmup_share the warm-up trains on GRPO's questions (the first run's split).
    assert {q["id"] for q in make_questions(split="warmup", holdout="question")} == \
        {q["id"] for q in make_questions(split="train", holdout="question")}
    with pytest.raises(ValueError, match="warmup_share"):
        make_questions(holdout="country", warmup_share=0.5)
    with pytest.raises(ValueError, match="warmup_share"):
        make_questions(holdout="question", warmup_share=1.0)
    with pytest.raises(ValueError, match="warmup_kinds needs"):
        make_questions(holdout="question", warmup_kinds=["capital"])


def test_every_expert_query_finds_its_evidence_first():
    index = default_index()
    for q in all_questions():
        for query, need in zip(q["queries"], q["evidence"], strict=True):
            top = index.search(query, k=1)[0]
            assert (top.country, top.field) == tuple(need), (q["id"], query)


def test_make_questions_takes_kinds_in_turn_and_cycles_past_the_pool():
    kinds = ("capital", "neighbour_capital")
    qs = make_questions(40, split="heldout", kinds=kinds, seed=5)
    assert Counter(q["kind"] for q in qs) == {"capital": 20, "neighbour_capital": 20}
    assert len({q["kind"] for q in qs[0::2]}) == 1 and len({q["kind"] for q in qs[1::2]}) == 1
    pool = [q for q in make_questions(split="heldout", kinds=("neighbour_capital",))]
    many = make_questions(len(pool) + 5, split="heldout", kinds=("neighbour_capital",), seed=1)
    assert {q["id"] for q in many} == {q["id"] for q in pool}  # all of them, then it starts over
    assert many[: len(pool)] != pool and many[len(pool):] == many[:5]
    # answer countries take turns: the first round names each country once (China has 75 questions)
    countries_seen = {q["country"] for q in pool}
    assert len({q["country"] for q in many[: len(countries_seen)]}) == len(countries_seen)
    with pytest.raises(ValueError, match="split"):
        make_questions(split="test")
    with pytest.raises(ValueError, match="unknown question kinds"):
        make_questions(kinds=("nope",))
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_questions(-1)


def test_reward_exact_match_f1_and_format():
    assert normalize_answer("The  Addis-Ababa!") == "addisababa"
    assert extract_answer("I think <answer> Paris </answer>") == "Paris"
    assert extract_answer("<answer>a</answer><answer>b</answer>") is None
    assert exact_match("the paris", ["Paris"]) == 1.0 and exact_match("Lyon", ["Paris"]) == 0.0
    assert f1("Addis", ["Addis Ababa"]) == pytest.approx(2 / 3)
    assert score("<answer>Paris</answer>", ["Paris"]) == 1.0
    assert score("<answer>Lyon</answer>", ["Paris"]) == pytest.approx(0.2)  # format only
    assert score("<answer>Lyon</answer>", ["Paris"], format_weight=0) == 0.0
    assert score("Paris", ["Paris"]) == 0.0  # no answer tag: nothing
    assert score("<answer>Addis</answer>", ["Addis Ababa"], metric="f1") == pytest.approx(0.2 + 0.8 * 2 / 3)
    with pytest.raises(ValueError, match="metric"):
        score("x", ["x"], metric="bleu")


def test_scripted_episodes_verify_and_never_train_tool_tokens(renderer):
    """The expert through the real loop: right answers, one search per hop, and the warm-up's expert chat
    is exactly the chat the loop records (so supervised warm-up trains on what rollouts look like)."""
    tokenizer = renderer.tokenizer
    tasks = [make_questions(1, kinds=(kind,), seed=1)[0] for kind in KINDS]
    scripts = {t["question"]: expert_replies(t) for t in tasks}

    def reply(prompt_text, turn):
        question = next(q for q in scripts if q in prompt_text)
        return scripts[question][turn]

    policy = ScriptedPolicy(tokenizer, reply)
    result = asyncio.run(generate_rollout(SearchR1Env, tasks, policy, renderer, n_samples_per_task=2))
    assert result.summary()["failed"] == 0
    assert result.summary()["tool_calls_mean"] == sum(HOPS[t["kind"]] for t in tasks) / len(tasks)
    for group, task in zip(result.groups, tasks, strict=True):
        assert len({e.group_id for e in group}) == 1
        for episode in group:
            m = episode.metrics
            assert m.reward == 1.0 and m.stop_reason == "no_tool_call"
            assert m.tool_calls == len(task["queries"]) and m.ill_formed_turns == 0
            assert episode.messages == expert_messages(task)
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


def test_reward_is_exact_match_of_the_answer(renderer):
    task = make_questions(1, kinds=("capital",), seed=2)[0]

    class WithFormat(SearchR1Env):
        format_weight = 0.2

    for env, final, expected in [(SearchR1Env, f"<answer>{task['answers'][0]}</answer>", 1.0),
                                 (SearchR1Env, "<answer>Atlantis</answer>", 0.0),
                                 (SearchR1Env, task["answers"][0], 0.0),  # no answer tag
                                 (WithFormat, "<answer>Atlantis</answer>", 0.2),
                                 (WithFormat, "I do not know.", 0.0)]:
        policy = ScriptedPolicy(renderer.tokenizer, [final])
        result = asyncio.run(generate_rollout(env, [task], policy, renderer))
        [episode] = result.episodes
        assert episode.metrics.reward == pytest.approx(expected) and episode.metrics.turns == 1


def test_expert_chats_fit_the_tiny_model():
    """Every question's expert chat fits the run's context, and every expert reply its per-turn budget."""
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer
    from agentrl.run.config import load_config

    cfg = load_config(CONFIG)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    renderer = ChatRenderer(tokenizer)
    kinds = cfg.task_kwargs["kinds"]
    questions = [q for q in all_questions() if q["kind"] in kinds]
    longest_chat = max(len(renderer.render(expert_messages(q), SearchR1Env.tool_schemas()).ids) for q in questions)
    longest_reply = max(len(tokenizer(r)["input_ids"]) for q in questions for r in expert_replies(q))
    assert longest_chat < cfg.model.max_position_embeddings
    assert longest_reply < cfg.rollout.max_new_tokens  # room for the closing <|im_end|>


def test_the_examples_tokenizer_makes_every_name_one_token_the_same_everywhere(tmp_path):
    """With ``model.tokenizer`` (examples/search_r1/tokenizer.py) the name a query must copy, and the capital
    an answer must copy, is one token (an added token: the same id wherever the name stands); chats decode
    to the same text as with the plain tiny tokenizer, in fewer tokens."""
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer
    from agentrl.run.config import load_config
    from examples.search_r1.synthetic import name_pool
    from examples.search_r1.tokenizer import names, write_tokenizer

    assert load_config(CONFIG).model.tokenizer == "examples.search_r1.tokenizer:write_tokenizer"
    write_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    plain = ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER_DIR))
    renderer = ChatRenderer(tokenizer)
    assert set(name_pool()) <= set(names())
    kw = load_config(CONFIG).task_kwargs
    tasks = (make_questions(40, split="heldout", seed=0, **kw) + make_questions(40, split="warmup", seed=1, **kw)
             + make_questions(40, split="train", seed=2, **kw))
    assert any(t.get("synthetic") for t in tasks)
    for task in tasks:
        messages = expert_messages(task)
        rendered = renderer.render(messages, SearchR1Env.tool_schemas(), add_generation_prompt=False)
        pieces = tokenizer.convert_ids_to_tokens(rendered.ids)
        copied = [task["country"], *([] if task["kind"] == "population_by_capital" else task["answers"])]
        for name in filter(str.isascii, copied):  # accented names stay BPE pieces (tokenizer.names says why)
            assert name in pieces, (task["id"], name)
        before = plain.render(messages, SearchR1Env.tool_schemas(), add_generation_prompt=False).ids
        assert tokenizer.decode(rendered.ids, skip_special_tokens=False) == \
            plain.tokenizer.decode(before, skip_special_tokens=False)
        assert len(rendered.ids) < len(before)


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


def test_plot_summary_takes_the_first_eval_row_as_the_warm_model(tmp_path):
    import json

    from examples.search_r1.plot import main, read_steps, summary

    rows = [{"warmup_step": 10, "eval_accuracy": 0.5},  # a warm-up row: not the warm model
            {"step": 0, "eval_accuracy": 0.25}]
    rows += [{"step": s, "rollout/reward_mean": s / 20, "rollout/tool_calls_mean": 1 + s / 10,
              **({"eval_accuracy": 0.25 + s / 40} if s % 5 == 0 else {})} for s in range(1, 21)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = summary(read_steps(path))
    assert got["warm_eval"] == 0.25 and got["final_eval"] == 0.75 and got["grpo_steps"] == 20
    assert got["eval_curve"] == [(0, 0.25), (5, 0.375), (10, 0.5), (15, 0.625), (20, 0.75)]
    assert got["search_calls_first_tenth"] == pytest.approx(1.15)  # steps 1-2; float sums, so approx
    assert got["search_calls_last_tenth"] == pytest.approx(2.95)
    assert main([str(path), str(tmp_path / "curve.png")]) == 0 and (tmp_path / "curve.png").stat().st_size > 0
    with pytest.raises(ValueError, match="eval_accuracy"):
        summary([{"step": 1, "rollout/reward_mean": 0.0}])


def test_made_up_questions_are_answered_by_their_own_documents_and_never_held_out(renderer):
    """Made-up countries (examples.search_r1.synthetic): every expert query finds its evidence first among the
    task's own documents, the expert chat answers through the env's search, and the share of made-up
    questions is seeded, per split, never held-out."""
    import random

    from examples.search_r1.synthetic import KINDS as MADE_UP_KINDS
    from examples.search_r1.synthetic import synthetic_question, task_index

    rng = random.Random(3)
    made_up = [synthetic_question(kind, rng, str(i)) for i in range(25) for kind in MADE_UP_KINDS]
    real_names = {c.name for c in countries()}
    for q in made_up:
        index = task_index(tuple(map(tuple, q["docs"])))
        for query, need in zip(q["queries"], q["evidence"], strict=True):
            top = index.search(query, k=1)[0]
            assert (top.country, top.field) == tuple(need)
        chat = expert_messages(q)
        assert chat[-1]["content"] == f"<answer>{q['answers'][0]}</answer>"
        assert q["answers"][0] in chat[-2]["content"]  # the last search result holds the answer
        assert q["country"] not in real_names and q["id"].startswith(f"synthetic-{q['kind']}:")
        assert len(renderer.render(chat, SearchR1Env.tool_schemas()).ids) < 512
    assert len({q["country"] for q in made_up}) > 90  # new names every question
    kwargs = dict(kinds=("capital", "neighbour_capital"), holdout="question", warmup_share=0.75)
    warm = make_questions(400, split="warmup", seed=1, warmup_synthetic=0.5, **kwargs)
    assert 150 < sum("docs" in q for q in warm) < 250
    assert Counter(q["kind"] for q in warm) == {"capital": 200, "neighbour_capital": 200}  # kinds kept
    assert warm == make_questions(400, split="warmup", seed=1, warmup_synthetic=0.5, **kwargs)  # seeded
    assert not any("docs" in q for q in make_questions(400, split="warmup", seed=1, train_synthetic=1.0, **kwargs))
    assert all("docs" in q for q in make_questions(8, split="train", seed=2, train_synthetic=1.0, **kwargs))
    assert not any("docs" in q for q in make_questions(
        100, split="heldout", seed=0, warmup_synthetic=1.0, train_synthetic=1.0, **kwargs))
    with pytest.raises(ValueError, match="train_synthetic"):
        make_questions(4, train_synthetic=1.5)


def test_made_up_worlds_with_real_names_put_real_names_in_random_relations(renderer):
    """synthetic_names="real": a made-up world names real countries and real capitals (the tokens held-out
    questions name) in random relations answered by the world's own documents; "both" draws either kind;
    an unknown source is refused before any question is made."""
    import random

    from examples.search_r1.synthetic import name_pool, real_names, synthetic_question, task_index

    country_names, capitals = real_names()
    true_capital = {c.name: c.capital for c in countries()}
    rng = random.Random(5)
    questions = [synthetic_question(kind, rng, str(i), "real") for i in range(25)
                 for kind in ("capital", "neighbour_capital")]
    for q in questions:
        index = task_index(tuple(map(tuple, q["docs"])))
        for query, need in zip(q["queries"], q["evidence"], strict=True):
            top = index.search(query, k=1)[0]
            assert (top.country, top.field) == tuple(need)
        assert q["country"] in country_names and q["answers"][0] in capitals
        assert expert_messages(q)[-1]["content"] == f"<answer>{q['answers'][0]}</answer>"
        assert len(renderer.render(expert_messages(q), SearchR1Env.tool_schemas()).ids) < 512
    # random relations: (almost) never the true capital, and the same country gets different capitals
    assert sum(q["answers"][0] == true_capital[q["country"]] for q in questions) <= 1
    pool = set(name_pool())
    both = [synthetic_question("capital", rng, str(i), "both")["country"] for i in range(40)]
    assert any(n in pool for n in both) and any(n in country_names for n in both)
    kwargs = dict(kinds=("capital", "neighbour_capital"), holdout="question", warmup_share=0.75,
                  warmup_synthetic=1.0)
    warm = make_questions(20, split="warmup", seed=1, synthetic_names="real", **kwargs)
    assert all(q["country"] in country_names and "docs" in q for q in warm)
    with pytest.raises(ValueError, match="synthetic_names"):
        make_questions(4, synthetic_names="invented", **kwargs)


def test_search_credit_rewards_grpo_searches_that_find_the_expert_documents():
    """train_search_credit w: GRPO's questions add w x the share of the expert's documents an episode's
    searches ranked first; warm-up and held-out questions never carry it (eval_accuracy stays exact match)."""
    kwargs = dict(kinds=("capital", "neighbour_capital"), holdout="question", warmup_share=0.75,
                  train_search_credit=0.5, train_synthetic=0.5)
    train = make_questions(16, split="train", seed=3, **kwargs)
    assert all(q["search_credit"] == 0.5 for q in train) and any("docs" in q for q in train)
    assert not any("search_credit" in q for s in ("warmup", "heldout") for q in make_questions(16, split=s, **kwargs))
    two_hop = next(q for q in train if q["kind"] == "neighbour_capital")

    def reward(task, queries, reply):
        env = SearchR1Env()
        env.reset(task)
        env.task = task
        for query in queries:
            env.search(query)
        env.on_text_response(reply)
        return env.reward()

    answer = f"<answer>{two_hop['answers'][0]}</answer>"
    assert reward(two_hop, two_hop["queries"], answer) == 1.5
    assert reward(two_hop, two_hop["queries"][:1], "no") == 0.25  # one of two documents found
    assert reward(two_hop, ["Nowhereland"], answer) == 1.0  # no hit
    assert reward({**two_hop, "search_credit": 0.0}, two_hop["queries"], "no") == 0.0
    with pytest.raises(ValueError, match="train_search_credit"):
        make_questions(4, train_search_credit=-1)
