"""A stand-in judge model for CPU smoke runs: a one-layer Qwen2 whose greedy reply to any prompt is " pass".

    python examples/judge_arithmetic/make_judge.py .cache/agentrl/judge-always-pass

Its weights are set by hand, not trained: every attention and MLP output projection is zero, so the last
hidden state is the (normalised) embedding of the last token; every token embeds to one direction, the token
" pass" to another, and the output head maps the first to " pass" and the second to the end-of-turn token.
So the reply is " pass" and then the end of the turn, whatever the prompt: the judge machinery (its own
engines, prompt template, batching, verdict parsing, metrics) runs end to end on the tiny model's
tokenizer, while the verdict carries no information (examples/judge_arithmetic/config.yaml weighs it 0).
For a judge that judges, point ``rollout.judge.model`` at an instruct model (see docs/distill_judge_eval.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

REPLY = " pass"


def make_always_pass_judge(out_dir: str | Path, *, context: int = 2048) -> Path:
    """Write the judge (config, weights, the tiny model's tokenizer and chat template) to ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from agentrl.models.tiny import TOKENIZER_DIR, copy_tokenizer

    out = copy_tokenizer(out_dir, TOKENIZER_DIR)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(REPLY, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ValueError(f"{REPLY!r} is {len(ids)} tokens in this vocabulary; the stand-in judge needs one")
    verdict, end = ids[0], tokenizer.eos_token_id
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=end,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.zero_()
            if "norm" in name:
                p.fill_(1.0)
        model.model.embed_tokens.weight[:, 0] = 1.0  # every token: direction 0 ...
        model.model.embed_tokens.weight[verdict] = torch.nn.functional.one_hot(torch.tensor(1), 16).float()  # ... but " pass"
        model.lm_head.weight[verdict, 0] = 10.0  # after any other token: " pass"
        model.lm_head.weight[end, 1] = 10.0  # after " pass": the end of the turn
    model.save_pretrained(out)
    return Path(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    print(make_always_pass_judge(parser.parse_args().out_dir))


if __name__ == "__main__":
    main()
