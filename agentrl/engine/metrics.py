"""Prometheus metrics of one engine (own registry, so several engines can live in one test process)."""

from __future__ import annotations


class EngineMetrics:
    """Counters and histograms served at ``GET /metrics``."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("agentrl_engine_requests", "generate requests received (one per sample)", registry=r)
        self.finished_requests = Counter(
            "agentrl_engine_finished_requests", "requests finished, by finish reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("agentrl_engine_prompt_tokens", "prompt tokens admitted", registry=r)
        self.cached_tokens = Counter(
            "agentrl_engine_cached_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.generated_tokens = Counter("agentrl_engine_generation_tokens", "tokens generated", registry=r)
        self.batch_size = Histogram(
            "agentrl_engine_batch_size", "running sequences per decode step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )
        self.bad_requests = Counter("agentrl_engine_bad_requests", "requests refused with 4xx", registry=r)
        self.weight_updates = Counter(
            "agentrl_engine_weight_updates", "weight updates applied, by method", ["method"], registry=r
        )
        self.running = Gauge("agentrl_engine_num_running_reqs", "running requests", registry=r)
        self.waiting = Gauge("agentrl_engine_num_waiting_reqs", "queued requests", registry=r)

    def observe_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)

    def observe_batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
