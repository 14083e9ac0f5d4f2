"""Between rollout and training: which GRPO groups are trained, and how stale their tokens are.

Groups are judged whole (a GRPO advantage needs every sample of its group). A filter plug-in decides which
groups are worth training on; the default drops groups whose rewards all agree (zero variance → zero
advantage, DAPO's dynamic sampling). Saved samples (JSONL) are written and read here too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from agentrl.trajectory import MODEL, Sample

GroupFilter = Callable[[list[Sample]], bool]


def has_reward_variance(group: list[Sample]) -> bool:
    """Keep a group only if its samples' rewards differ (otherwise every advantage is zero)."""
    return len({s.reward for s in group}) > 1


def keep_all(group: list[Sample]) -> bool:
    return True


def version_number(weight_version: str | None) -> int | None:
    """A run's weight versions are the trainer step that produced them (``"0"``, ``"1"``, ...); anything
    else (``None``, ``"warmup"``, a user's label) has no known distance to the trainer and is ``None``."""
    if weight_version is None:
        return None
    try:
        return int(weight_version)
    except ValueError:
        return None


def trained_token_versions(sample: Sample) -> Counter[int | None]:
    """How many trained tokens (loss mask 1) each weight version produced, read per token from the
    sample's provenance (a multi-turn sample spans several versions when weights changed between turns)."""
    counts: Counter[int | None] = Counter()
    start = sample.response_start
    for run in sample.provenance.runs:
        lo, hi = max(run.start, start), run.end
        if hi <= lo:
            continue
        trained = sum(sample.loss_mask[lo - start : hi - start])
        if trained:
            # only model tokens can be trained; a trained token of another source has no version to show
            counts[version_number(run.weight_version) if run.source == MODEL else None] += trained
    return counts


def group_lag(group: list[Sample], trainer_version: int) -> int | None:
    """The largest version lag (``trainer_version - v``) among the group's trained tokens; None when some
    trained token's version is unknown (it cannot be shown to be fresh). 0 for a group with no trained token."""
    lags = [0]
    for sample in group:
        for version in trained_token_versions(sample):
            if version is None:
                return None
            lags.append(trainer_version - version)
    return max(lags)


def staleness_metrics(samples: Iterable[Sample], trainer_version: int) -> dict[str, float]:
    """Version lag of every trained token against the weights being trained (``trainer_version``):
    ``rollout/staleness_max`` and ``_mean`` (token-weighted), and ``rollout/staleness_hist/<lag>``, the
    trained tokens at each lag (``unknown``: a version that is not a step number). A batch that trains no
    token of a known version has no lag: max and mean are left out, not reported as 0 (a step whose groups
    were all filtered would otherwise read as fresh under a schedule that is one step off)."""
    hist: Counter[int | None] = Counter()
    for sample in samples:
        for version, n in trained_token_versions(sample).items():
            hist[None if version is None else trainer_version - version] += n
    known = dict(sorted((lag, n) for lag, n in hist.items() if lag is not None))
    out = {f"rollout/staleness_hist/{lag}": float(n) for lag, n in known.items()}
    if known:
        out["rollout/staleness_max"] = float(max(known))
        out["rollout/staleness_mean"] = sum(lag * n for lag, n in known.items()) / sum(known.values())
    if hist[None]:
        out["rollout/staleness_hist/unknown"] = float(hist[None])
    return out


class DataBuffer:
    """The group filter between rollout and training, and its counts (checkpointed): a GRPO group (the
    samples of one task, sharing ``group_id``) is trained only when ``group_filter`` keeps it. The episode
    pool holds groups until the trainer takes them; this object only judges and counts them."""

    def __init__(self, group_filter: GroupFilter = has_reward_variance) -> None:
        self._filter = group_filter
        self.groups_added = 0
        self.groups_dropped = 0

    def keeps(self, group: list[Sample]) -> bool:
        """Whether the group filter keeps ``group``; counted in ``groups_added`` / ``groups_dropped``."""
        self.groups_added += 1
        kept = bool(self._filter(group))
        self.groups_dropped += not kept
        return kept

    def kept(self, groups: Iterable[list[Sample]]) -> list[list[Sample]]:
        """The non-empty groups of ``groups`` the filter keeps, in order."""
        return [group for group in groups if group and self.keeps(group)]

    def state_dict(self) -> dict:
        return {"groups_added": self.groups_added, "groups_dropped": self.groups_dropped}

    def load_state_dict(self, state: dict) -> None:
        # Checkpoints written before the episode pool also hold a cursor and pending groups; the pool
        # never left groups here, so there is nothing of them to restore.
        self.groups_added = state["groups_added"]
        self.groups_dropped = state["groups_dropped"]


def save_samples_jsonl(samples: Iterable[Sample], path: str | Path) -> int:
    """Write samples one JSON object per line; returns the count (rollout-only debug mode)."""
    n = 0
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict()) + "\n")
            n += 1
    return n


def load_samples_jsonl(path: str | Path) -> list[Sample]:
    """Read samples written by :func:`save_samples_jsonl` (train-only debug mode)."""
    with open(path) as f:
        return [Sample.from_dict(json.loads(line)) for line in f if line.strip()]
