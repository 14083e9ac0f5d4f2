"""``agentrl dump`` / ``python -m agentrl.trajectory.dump FILE``: print samples token by token.

Each token is shown with its position, id, (decoded text with ``--tokenizer``), loss mask, rollout
log-prob and provenance; drift points are marked. FILE holds one sample dict, a JSON list of them, or
JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from agentrl.trajectory.provenance import SOURCES
from agentrl.trajectory.sample import Sample

_SOURCE_WIDTH = max(len(source) for source in SOURCES)  # the source column fits every name

Decoder = Callable[[int], str]


def load_samples(path: str | Path) -> list[Sample]:
    """Read samples from a JSON object, a JSON list, or JSON lines."""
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"{path}: empty file")
    try:
        data = json.loads(stripped)
        items = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    samples = []
    for index, item in enumerate(items):
        try:
            samples.append(Sample.from_dict(item))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: sample {index}: {exc}") from None
    return samples


def load_decoder(tokenizer_dir: str) -> Decoder:
    """Per-token decoder for a tokenizer directory (``tokenizers`` if it has tokenizer.json, else transformers)."""
    path = Path(tokenizer_dir)
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda token: tok.decode([token], skip_special_tokens=False)
    from transformers import AutoTokenizer  # heavy: only when a tokenizer without tokenizer.json is given

    hf = AutoTokenizer.from_pretrained(str(path))
    return lambda token: hf.decode([token], skip_special_tokens=False)


def _header(index: int, s: Sample) -> list[str]:
    meta = s.metadata
    lines = [
        f"== sample {index}  session={s.session_id!r}  group={s.group_id!r}  reward={s.reward!r}  status={s.status}",
        f"   tokens={len(s.tokens)}  response_start={s.response_start}  trained={sum(s.loss_mask)}"
        f"  turns={meta.get('turns')}  outcomes={meta.get('outcomes')}",
    ]
    for key in (
        "trained_turns",
        "untrained_turns",
        "lost_turns",
        "forked",
        "branched",
        "truncated",
        "use_tool",
    ):
        if meta.get(key):
            lines.append(f"   {key}: {meta[key]}")
    for point in meta.get("drift_points", []):
        lines.append(
            f"   drift: turn {point['turn']} left the held tokens at {point['position']} -> {point['outcome']}"
        )
    return lines


def format_runs(s: Sample) -> list[str]:
    """One line per provenance run: the compact view of a sample."""
    rs = s.response_start
    lines = ["   runs:  [start, end)  source     turn  weights   trained"]
    for run in s.provenance.runs:
        lo, hi = max(run.start, rs) - rs, max(run.end, rs) - rs
        trained = sum(s.loss_mask[lo:hi]) if run.end > rs else 0
        lines.append(
            f"          [{run.start:>5}, {run.end:>5})  {run.source:<{_SOURCE_WIDTH}}  {run.turn:>4}  {run.weight_version or '-':<8}  "
            f"{trained}/{run.end - run.start}"
        )
    return lines


def format_chat(messages: list[dict]) -> list[str]:
    """The episode's messages as a person reads them: role, then the text (tool calls and results as sent)."""
    lines = []
    for m in messages:
        name = f" ({m['name']})" if m.get("name") else ""
        lines.append(f"  [{m.get('role', '?')}{name}]")
        lines += [f"    {line}" for line in str(m.get("content", "")).splitlines() or [""]]
    return lines + ([""] if lines else [])


def format_sample(
    index: int, s: Sample, decode: Decoder | None = None, max_tokens: int = 0, runs: bool = False
) -> str:
    """The readable dump of one sample (and its chat, when its metadata carries one: ``samples/`` files)."""
    lines = _header(index, s)
    lines += format_chat(s.metadata.get("messages") or [])
    lines += format_runs(s)
    if runs:
        return "\n".join(lines)
    drift_at = {p["position"]: p for p in s.metadata.get("drift_points", [])}
    rs = s.response_start
    lines.append(f"   {'pos':>5} {'id':>7}  mask {'logprob':>9}  {'source':<{_SOURCE_WIDTH}} turn  weights   text")
    shown = range(len(s.tokens)) if max_tokens <= 0 else range(min(len(s.tokens), max_tokens))
    previous = None
    for i in shown:
        prov = s.provenance[i]
        if previous is not None and prov[:2] != previous[:2]:
            lines.append("   " + "-" * 60)
        previous = prov
        mask = "." if i < rs else str(s.loss_mask[i - rs])
        lp = "." if i < rs else f"{s.rollout_logprobs[i - rs]:.4f}"
        text = repr(decode(s.tokens[i])) if decode else ""
        mark = ""
        if i in drift_at:
            mark = (
                f"   <<< drift: turn {drift_at[i]['turn']} re-rendered from here ({drift_at[i]['outcome']})"
            )
        lines.append(
            f"   {i:>5} {s.tokens[i]:>7}  {mask:>4} {lp:>9}  {prov.source:<{_SOURCE_WIDTH}} {prov.turn:>4}  "
            f"{prov.weight_version or '-':<8}  {text}{mark}"
        )
    if len(shown) < len(s.tokens):
        lines.append(f"   ... {len(s.tokens) - len(shown)} more tokens (--max-tokens 0 shows all)")
    return "\n".join(lines)


def dump(
    samples: Iterable[Sample], decode: Decoder | None = None, max_tokens: int = 0, runs: bool = False
) -> str:
    return "\n\n".join(format_sample(i, s, decode, max_tokens, runs) for i, s in enumerate(samples))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl dump", description=__doc__.splitlines()[0])
    parser.add_argument("file", help="JSON sample, JSON list of samples, or JSONL")
    parser.add_argument("--tokenizer", help="tokenizer directory: decode each token")
    parser.add_argument("--max-tokens", type=int, default=0, help="show at most N tokens per sample (0: all)")
    parser.add_argument("--runs", action="store_true", help="only the header and provenance runs")
    args = parser.parse_args(argv)
    try:
        samples = load_samples(args.file)
        decode = load_decoder(args.tokenizer) if args.tokenizer else None
    except (OSError, ValueError) as exc:
        print(f"agentrl dump: {exc}", file=sys.stderr)
        return 2
    print(dump(samples, decode, args.max_tokens, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
