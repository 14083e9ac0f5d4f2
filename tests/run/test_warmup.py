"""Supervised warm-up: the teacher-forced check and stopping on measured held-out accuracy."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.envs.arithmetic import ArithmeticEnv, expert_messages, make_tasks  # noqa: E402
from agentrl.envs.render import ChatRenderer  # noqa: E402
from agentrl.models.tiny import make_tiny_model  # noqa: E402
from agentrl.run.warmup import WarmupConfig, supervised_warmup, teacher_forced_accuracy  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def chats(n: int, seed: int = 0):
    return [(expert_messages(t), ArithmeticEnv.tool_schemas()) for t in make_tasks(n, seed=seed)]


def greedy_row(model, tokenizer, n_new: int = 6):
    """A (ids, mask) row whose assistant tokens are exactly the model's own greedy continuation."""
    renderer = ChatRenderer(tokenizer)
    messages, tools = chats(1)[0]
    prompt = renderer.render(messages[:-1], tools).ids
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids, [0] * len(prompt) + [1] * n_new


def test_teacher_forced_accuracy_counts_only_exact_rows(tiny):
    _, model, tokenizer = tiny
    ids, mask = greedy_row(model, tokenizer)
    wrong = list(ids)
    wrong[-2] = (wrong[-2] + 1) % len(tokenizer)
    pad = tokenizer.pad_token_id
    assert teacher_forced_accuracy(model, [(ids, mask)], pad) == 1.0
    assert teacher_forced_accuracy(model, [(wrong, mask)], pad) == 0.0
    assert teacher_forced_accuracy(model, [(ids, mask), (wrong, mask), (ids, mask), (wrong, mask)], pad, chunk=3) == 0.5
    assert teacher_forced_accuracy(model, [], pad) == 0.0


def test_warmup_stops_once_real_evaluation_reaches_target(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _, tokenizer = tiny
    train = chats(4)
    renderer = ChatRenderer(tokenizer)
    rows = [(r.ids, r.assistant_mask) for r in (renderer.render(m, t, add_generation_prompt=False) for m, t in train)]
    evaluated: list[float] = []

    def evaluate(saved):  # the saved model, reloaded: what the engines would serve
        model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
        evaluated.append(teacher_forced_accuracy(model, rows, tokenizer.pad_token_id))
        return evaluated[-1]

    config = WarmupConfig(lr=3e-3, batch_size=4, max_steps=400, check_every=5, eval_every=1000, target_accuracy=1.0)
    result = supervised_warmup(path, tmp_path / "warm", train, evaluate, config, heldout=train)
    assert result.accuracy == 1.0 and evaluated[-1] == 1.0
    assert result.steps < config.max_steps
    assert result.history[-1]["eval_accuracy"] == 1.0 and result.history[-1]["warmup_check_accuracy"] == 1.0
    assert all(r["warmup_check_accuracy"] >= 1.0 for r in result.history)  # real evals only when promising


def test_warmup_budget_ends_with_a_real_evaluation(tiny, tmp_path):
    path, _, _ = tiny
    calls: list[str] = []
    config = WarmupConfig(max_steps=50, check_every=5, eval_every=1000, target_accuracy=1.0, max_minutes=1e-9)
    result = supervised_warmup(path, tmp_path / "warm", chats(4), lambda p: calls.append(str(p)) or 0.0, config,
                               heldout=chats(4, seed=1))
    assert result.steps == 1 and calls == [str(tmp_path / "warm")]
    assert (tmp_path / "warm" / "model.safetensors").exists()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("below_measures, kept", [(0.26, "below"), (0.05, "above")])
def test_the_step_before_an_overshooting_jump_is_kept_when_it_measures_nearer(tiny, tmp_path, below_measures, kept):
    from transformers import AutoModelForCausalLM

    from agentrl.run.warmup import _keep_nearer

    path, _, tokenizer = tiny
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    below = _weights(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)  # the "crossing" step's weights
    above = _weights(model)
    out = tmp_path / "warm"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    def evaluate(saved):
        loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).model.embed_tokens.weight
        return below_measures if torch.equal(loaded, below["model.embed_tokens.weight"]) else 0.41

    history: list[dict] = []
    step, accuracy = _keep_nearer(model, tokenizer, out, evaluate, 0.3, (213, 0.265, below), (214, 0.41), history, None)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).model.embed_tokens.weight
    if kept == "below":
        assert (step, accuracy) == (213, 0.26)
        assert torch.equal(saved, below["model.embed_tokens.weight"])
        assert history == [{"warmup_step": 214, "warmup_kept_step": 213, "warmup_check_accuracy": 0.265,
                            "eval_accuracy": 0.26}]
    else:  # the earlier weights measured farther from the target than the crossing ones: those stay
        assert (step, accuracy) == (214, 0.41)
        assert torch.equal(saved, above["model.embed_tokens.weight"]) and history == []


def test_a_check_farther_from_the_target_costs_no_extra_evaluation(tiny, tmp_path):
    from agentrl.run.warmup import _keep_nearer

    path, model, tokenizer = tiny
    calls: list[str] = []
    result = _keep_nearer(model, tokenizer, tmp_path, lambda p: calls.append(p) or 0.0, 0.3,
                          (99, 0.05, _weights(model)), (100, 0.33), [], None)
    assert result == (100, 0.33) and calls == []


def test_warmup_renders_chats_with_the_runs_chat_template_kwargs(tiny, tmp_path, monkeypatch):
    path, _, _ = tiny
    seen: list[dict] = []
    original = ChatRenderer.__init__

    def spy(self, tokenizer, **kwargs):
        seen.append(kwargs)
        original(self, tokenizer, **kwargs)

    monkeypatch.setattr(ChatRenderer, "__init__", spy)
    config = WarmupConfig(max_steps=5, check_every=5, eval_every=1000, target_accuracy=1.0, max_minutes=1e-9)
    supervised_warmup(path, tmp_path / "warm", chats(2), lambda p: 0.0, config,
                      chat_template_kwargs={"enable_thinking": False})
    assert seen == [{"enable_thinking": False}]
