"""Which samples of a step the list shows: the filters of the page, applied to summaries."""

from __future__ import annotations

from pydantic import BaseModel, Field

from agentrl.view.run_dir import SampleSummary

MAX_PAGE = 500  # samples per API page: a page of 10k samples loads in slices, never whole


class SampleFilter(BaseModel):
    """Every given field must hold (``q``: a case-insensitive substring of the chat)."""

    reward_min: float | None = None
    reward_max: float | None = None
    status: str | None = None
    outcome: str | None = Field(None, description="a turn outcome the sample has (clean, realigned, cut, ...)")
    stop_reason: str | None = None
    task: str | None = None
    q: str | None = Field(None, max_length=200)

    def keeps(self, s: SampleSummary) -> bool:
        return ((self.reward_min is None or s.reward >= self.reward_min)
                and (self.reward_max is None or s.reward <= self.reward_max)
                and (not self.status or s.status == self.status)
                and (not self.outcome or self.outcome in s.outcomes)
                and (not self.stop_reason or s.stop_reason == self.stop_reason)
                and (not self.task or s.task == self.task)
                and (not self.q or self.q.lower() in s.text))
