"""Build a tiny random-init model with the bundled test tokenizer (no hub access).

``qwen2`` (default): 0.62M parameters, 2.5 MB, fast enough for RL on two CPU cores. ``qwen3_moe``: the same
attention shape with Qwen3's q/k norms and a mixture-of-experts MLP in every layer (:data:`TINY_MOE_SHAPE`:
8 experts of width 64, top-2, renormalised top-k weights).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

TOKENIZER_DIR = Path(__file__).parent / "assets" / "tiny_tokenizer"
TINY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
# Expert fields of the qwen3_moe tiny model (added to TINY_SHAPE; intermediate_size is unused: every layer is MoE).
TINY_MOE_SHAPE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    head_dim=32,
)
ARCHS = ("qwen2", "qwen3_moe")


def copy_tokenizer(out_dir: str | Path, tokenizer_dir: str | Path = TOKENIZER_DIR) -> Path:
    """Copy a tokenizer directory (tokenizer.json, config, chat template; default the bundled tiny one)
    into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy2(f, out / f.name)
    return out


def make_tiny_model(out_dir: str | Path, *, seed: int = 0, tokenizer_dir: str | Path = TOKENIZER_DIR,
                    arch: str = "qwen2", **overrides: int) -> Path:
    """Write a random-init model of ``arch`` (one of :data:`ARCHS`) plus tokenizer to ``out_dir`` and return
    the path.

    ``tokenizer_dir``: the tokenizer to copy in (default the bundled tiny one); the vocabulary is its
    ``len(tokenizer)``, added tokens included. ``overrides`` replace fields of :data:`TINY_SHAPE` (and, for
    ``qwen3_moe``, of :data:`TINY_MOE_SHAPE`), e.g. ``max_position_embeddings=1024``.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    out = copy_tokenizer(out_dir, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(out)
    moe = arch == "qwen3_moe"
    shape = {**TINY_SHAPE, **(TINY_MOE_SHAPE if moe else {}), **overrides}
    config_class, model_class = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="agentrl make-tiny-model", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arch", choices=ARCHS, default="qwen2", help="qwen2 (dense) or qwen3_moe (8 experts, top-2)")
    parser.add_argument("--max-position-embeddings", type=int, default=TINY_SHAPE["max_position_embeddings"])
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out_dir, seed=args.seed, arch=args.arch, max_position_embeddings=args.max_position_embeddings)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
