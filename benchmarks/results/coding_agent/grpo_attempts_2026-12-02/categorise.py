"""Categorise greedy episodes: pass / format (no valid write) / wrong op / wrong constant / wrong name / other."""

import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repo root
from examples.coding_agent import oneliners as o


def written_code(msgs):
    code = None
    for m in msgs:
        if m["role"] == "assistant":
            mm = re.search(r"<tool_call>(.*?)</tool_call>", m["content"], re.S)
            if mm:
                try:
                    call = json.loads(mm.group(1))
                    if (
                        call.get("name") == "write"
                        and isinstance(call.get("arguments"), dict)
                        and "code" in call["arguments"]
                    ):
                        code = call["arguments"]["code"]
                except Exception:
                    pass
    return code


def norm(e):
    return re.sub(r"\s+", "", e)


def category(row):
    if row["reward"] == 1:
        return "pass"
    task = row["task"]
    spec = task["spec"]
    code = written_code(row["messages"])
    if code is None:
        return "format(no write)"
    ref = norm(o.solution_body(task))
    got = norm(code)
    if got == ref:
        return "ref-but-failed?"
    # identifiers in code
    args = spec["args"]
    ids = set(re.findall(r"[A-Za-z_]\w*", code)) - {
        "return",
        "for",
        "in",
        "if",
        "v",
        "sorted",
        "sum",
        "max",
        "min",
        "len",
        "count",
        "upper",
    }
    bool(ids - set(args)) or not all(a in ids for a in args)

    # replace names by placeholders and constants by K
    def skel(s, names):
        for i, a in enumerate(names):
            s = re.sub(rf"\b{a}\b", f"A{i}", s)
        return s

    skel(ref, args)
    [a for a in re.findall(r"\b[a-z]\w*\b", got) if a in ids]
    # op skeleton: strip digits
    ref_op = re.sub(r"\d+", "K", re.sub(r"\b(xs|ys|nums|vals|items|s|t|word|text|a|b|x|y|n|m)\b", "N", ref))
    got_op = re.sub(r"\d+", "K", re.sub(r"\b(xs|ys|nums|vals|items|s|t|word|text|a|b|x|y|n|m)\b", "N", got))
    if ref_op != got_op:
        return "wrong op"
    # same op skeleton: constant or name
    ref_consts = re.findall(r"\d+", ref)
    got_consts = re.findall(r"\d+", got)
    wrong_k = ref_consts != got_consts
    # names in order
    ref_n = re.findall(r"\b(?:xs|ys|nums|vals|items|s|t|word|text|a|b|x|y|n|m)\b", ref)
    got_n = re.findall(r"\b(?:xs|ys|nums|vals|items|s|t|word|text|a|b|x|y|n|m)\b", got)
    wrong_n = ref_n != got_n
    if wrong_k and wrong_n:
        return "wrong name+const"
    if wrong_k:
        return "wrong constant"
    if wrong_n:
        return "wrong name"
    return "other"


def summarise(path):
    rows = json.loads(Path(path).read_text())
    out = {}
    for split in ("heldout", "train"):
        rs = [r for r in rows if r["split"] == split]
        c = collections.Counter(category(r) for r in rs)
        per_op = collections.defaultdict(lambda: [0, 0])
        for r in rs:
            op = "+".join(r["task"]["spec"]["ops"])
            per_op[op][0] += r["reward"]
            per_op[op][1] += 1
        ill = sum(1 for r in rs if r.get("ill"))
        ctx = sum(1 for r in rs if r.get("stop") and "context" in str(r["stop"]))
        nturns = collections.Counter(sum(1 for m in r["messages"] if m["role"] == "assistant") for r in rs)
        rt_fail_then_submit = sum(
            1 for r in rs if any(m["role"] == "tool" and "0/1" in m["content"] for m in r["messages"])
        )
        rewrite = sum(
            1
            for r in rs
            if sum(1 for m in r["messages"] if m["role"] == "assistant" and '"write"' in m["content"]) > 1
        )
        out[split] = dict(
            n=len(rs),
            acc=sum(r["reward"] for r in rs) / len(rs),
            categories=dict(c.most_common()),
            episodes_with_ill_formed=ill,
            stopped_context=ctx,
            assistant_turns=dict(sorted(nturns.items())),
            saw_FAIL=rt_fail_then_submit,
            rewrote=rewrite,
            per_op={k: f"{v[0]:.0f}/{v[1]}" for k, v in sorted(per_op.items(), key=lambda kv: -kv[1][1])},
        )
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p)
        print(json.dumps(summarise(p), indent=1))
