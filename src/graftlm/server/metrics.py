"""Prometheus metrics of one server (its own registry, so several servers can live in a process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from graftlm.runtime.service import CacheFacts

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    """Requests and tokens by adapter, queue and batch sizes, latencies, resident adapters.

    Also the engine service's observer (`on_step`, called from the engine thread; prometheus
    client metrics are thread-safe)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "graftlm_requests",
            "Finished generation requests, by adapter ('base': none) and endpoint",
            ["adapter", "endpoint"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "graftlm_prompt_tokens", "Prompt tokens evaluated, by adapter", ["adapter"], registry=r
        )
        self.generation_tokens = Counter(
            "graftlm_generation_tokens", "Tokens generated, by adapter", ["adapter"], registry=r
        )
        self.errors = Counter(
            "graftlm_request_errors",
            "Requests answered with an error, by status",
            ["status"],
            registry=r,
        )
        self.running = Gauge("graftlm_requests_running", "Requests generating now", registry=r)
        self.waiting = Gauge(
            "graftlm_requests_waiting", "Requests queued for a generation slot", registry=r
        )
        self.batch_size = Histogram(
            "graftlm_batch_size",
            "Sequences in one engine step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.ttft = Histogram(
            "graftlm_time_to_first_token_seconds",
            "Seconds from arrival to the first generated token",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "graftlm_time_per_output_token_seconds",
            "Mean seconds per generated token after the first",
            buckets=_TPOT,
            registry=r,
        )
        self.adapters_resident = Gauge(
            "graftlm_lora_adapters_resident", "LoRA adapters attached", registry=r
        )
        self.adapter_loads = Counter(
            "graftlm_lora_adapter_loads",
            "Adapters attached on first use (read and transformed), by name",
            ["adapter"],
            registry=r,
        )
        self.adapter_bytes = Gauge(
            "graftlm_lora_adapter_bytes", "Bytes held by attached LoRA adapters", registry=r
        )
        self.kv_blocks = Gauge(
            "graftlm_kv_cache_blocks",
            "Blocks of the paged KV cache: total, used (held by requests), cached (found by "
            "the prefix cache, held or not)",
            ["state"],
            registry=r,
        )
        self.kv_block_tokens = Gauge(
            "graftlm_kv_cache_block_tokens", "Positions one KV cache block holds", registry=r
        )
        self.kv_bytes = Gauge("graftlm_kv_cache_bytes", "Bytes of the KV cache pool", registry=r)
        self.prefix_queries = Counter(
            "graftlm_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            "graftlm_prefix_cache_hits",
            "Prompt tokens the prefix cache served (not computed)",
            registry=r,
        )
        self.prefix_evictions = Counter(
            "graftlm_prefix_cache_evictions", "Cached blocks evicted for new ones", registry=r
        )
        self._seen = (0, 0, 0)

    # -- ServiceObserver --
    def on_step(self, rows: int, running: int, waiting: int) -> None:
        if rows > 0:
            self.batch_size.observe(rows)
        self.running.set(running)
        self.waiting.set(waiting)

    def on_cache(self, facts: CacheFacts) -> None:
        self.kv_blocks.labels("total").set(facts.blocks_total)
        self.kv_blocks.labels("used").set(facts.blocks_used)
        self.kv_blocks.labels("cached").set(facts.blocks_cached)
        self.kv_block_tokens.set(facts.block_tokens)
        self.kv_bytes.set(facts.nbytes)
        q, h, e = facts.query_tokens, facts.hit_tokens, facts.evicted
        self.prefix_queries.inc(q - self._seen[0])
        self.prefix_hits.inc(h - self._seen[1])
        self.prefix_evictions.inc(e - self._seen[2])
        self._seen = (q, h, e)

    # -- from the routes --
    def finished(
        self,
        adapters: list[str],
        endpoint: str,
        n_prompt: int,
        n_generated: int,
        ttft: float | None,
        tpot: float | None,
    ) -> None:
        """One finished sequence; it counts once for every adapter it used."""
        for name in adapters or ["base"]:
            self.requests.labels(name, endpoint).inc()
            self.prompt_tokens.labels(name).inc(n_prompt)
            self.generation_tokens.labels(name).inc(n_generated)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def adapter_loaded(self, name: str) -> None:
        self.adapter_loads.labels(name).inc()

    def adapters(self, resident: int, nbytes: int) -> None:
        self.adapters_resident.set(resident)
        self.adapter_bytes.set(nbytes)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
