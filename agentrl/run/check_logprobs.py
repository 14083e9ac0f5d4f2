"""``agentrl check-logprobs``: do the rollout engine and the Megatron trainer agree on log-probs?

Starts an embedded engine on the model, samples N multi-turn conversations through its native
``/generate`` (``return_logprob: true``), recomputes the log-probs of every sampled token with Megatron
and prints one JSON line: ``max_abs_diff``, ``mean_abs_diff``, ``n_tokens`` (plus ``n_samples``; for a
mixture-of-experts model also ``replay``: the same with the engine's experts replayed in the trainer). Run it
before a long job (slime's ``--ci-test`` idea): a large gap means the sampler and trainer disagree
(precision, kernels, chat template), and importance ratios will be off from step 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.request
from typing import Any

FOLLOW_UPS = ["Are you sure?", "Explain briefly.", "And what is 2+2?", "Say it again."]
QUESTIONS = ["What is {a}+{b}?", "Compute {a} plus {b}.", "Tell me a short story about {a} cats."]


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _generate(url: str, input_ids: list[int], max_new_tokens: int, temperature: float,
              routing: bool = False) -> tuple[list[int], list[float], list[Any] | None]:
    out = _post(url + "/generate", {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
        "return_logprob": True,
        **({"return_routed_experts": True} if routing else {}),
    })
    from agentrl.trajectory import TurnRecord

    turn = TurnRecord.from_generate_response(input_ids, out)
    routed = None if turn.routed_experts is None else [list(r) for r in turn.routed_experts]
    return list(turn.output_ids), list(turn.output_logprobs), routed


def sample_conversations(url: str, tokenizer: Any, n: int, *, turns: int = 2, max_new_tokens: int = 24,
                         temperature: float = 1.0, seed: int = 0, routing: bool = False) -> list[dict[str, Any]]:
    """``n`` multi-turn Samples (plain dicts): model turns trained, user turns masked (``routing``: with the
    engine's routed experts for the model turns' tokens)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        question = rng.choice(QUESTIONS).format(a=rng.randint(10, 99), b=rng.randint(10, 99))
        tokens = list(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                    add_generation_prompt=True, tokenize=True, return_dict=False))
        start = len(tokens)
        mask: list[int] = []
        logprobs: list[float] = []
        routed: list[Any] = []
        for turn in range(turns):
            out, lps, experts = _generate(url, tokens, max_new_tokens, temperature, routing)
            tokens += out
            mask += [1] * len(out)
            logprobs += lps
            routed += experts or [None] * len(out)
            if turn + 1 < turns:
                # The next user turn as the chat template renders it (never trained).
                follow = tokenizer.encode(
                    f"<|im_end|>\n<|im_start|>user\n{rng.choice(FOLLOW_UPS)}<|im_end|>\n<|im_start|>assistant\n",
                    add_special_tokens=False,
                )
                tokens += follow
                mask += [0] * len(follow)
                logprobs += [0.0] * len(follow)
                routed += [None] * len(follow)
        samples.append({"tokens": tokens, "response_start": start, "loss_mask": mask,
                        "rollout_logprobs": logprobs, "reward": 0.0, "group_id": len(samples),
                        **({"routed_experts": routed} if routing else {})})
    return samples


def compare(samples: list[dict[str, Any]], trainer_logprobs: list[list[float]]) -> dict[str, float]:
    """Max / mean absolute difference over trained tokens."""
    diffs = [
        abs(a - b)
        for s, lps in zip(samples, trainer_logprobs, strict=True)
        for m, a, b in zip(s["loss_mask"], s["rollout_logprobs"], lps, strict=True)
        if m
    ]
    if not diffs:
        raise RuntimeError("the engine produced no tokens to compare")
    return {"max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / len(diffs), "n_tokens": len(diffs),
            "n_samples": len(samples)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl check-logprobs", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", help="local HF model directory (or --model)")
    parser.add_argument("--model", help="local HF model directory")
    parser.add_argument("--samples", type=int, default=8, help="number of conversations to sample")
    parser.add_argument("--turns", type=int, default=2, help="model turns per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-above", type=float, default=None,
                        help="exit 1 when max_abs_diff exceeds this (default: report only)")
    args = parser.parse_args(argv)
    if (args.model_dir is None) == (args.model is None):
        parser.error("give the model directory once: as the argument or as --model")
    args.model = args.model or args.model_dir
    if args.samples < 1 or args.turns < 1:
        parser.error("--samples and --turns must be >= 1")

    from pathlib import Path

    if not (Path(args.model) / "config.json").is_file():
        print(f"agentrl check-logprobs: {args.model} is not a HF model directory (no config.json)", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    from agentrl.engine.launch import EngineProcess
    from agentrl.engine.protocol import routes_experts

    routing = routes_experts(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = EngineProcess(args.model, port=None, dtype=args.dtype)
    try:
        engine.start()
        engine.wait_healthy(timeout=180)
        samples = sample_conversations(engine.url, tokenizer, args.samples, turns=args.turns,
                                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                       seed=args.seed, routing=routing)
    finally:
        engine.stop()

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(args.model, TrainerConfig(dtype=args.dtype), temperature=args.temperature)
    trainer.moe.replay = False  # the headline number: the trainer routing on its own
    result = compare(samples, trainer.compute_logprobs(samples))
    if routing:
        trainer.moe.replay = True
        replayed = compare(samples, trainer.compute_logprobs(samples))
        result["replay"] = {k: replayed[k] for k in ("max_abs_diff", "mean_abs_diff")}
    print(json.dumps(result), flush=True)
    if args.fail_above is not None and result["max_abs_diff"] > args.fail_above:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
