"""Prometheus metrics of one server (its own registry, so several servers can live in a process):
graftlm's own (`graftlm_*`, by adapter), and beside them llama-server's (`llamacpp:*`, the same
names, types and meanings), so that dashboards made for llama-server read this server too."""

from __future__ import annotations

import threading
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from graftlm.runtime.service import CacheFacts, FinishEvent, StepWork

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# an adapter's cold attach: a few ms to a few hundred, finely where the 50 ms goal lies
_ATTACH = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    """Requests and tokens by adapter, queue and batch sizes, latencies, resident adapters.

    Also the engine service's observer (`on_step`, called from the engine thread; prometheus
    client metrics are thread-safe)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._request_metrics(self.registry)
        self._adapter_metrics(self.registry)
        self._cache_metrics(self.registry)
        self._step_metrics(self.registry)
        self._seen = (0, 0, 0)
        self.llama = LlamaMetrics()
        self.started = time.time()

    def _step_metrics(self, r: CollectorRegistry) -> None:
        """What the engine's steps computed and what they cost (served traffic against the
        step measured alone: rows a step, padding, CPU a generated token)."""
        self.forwards = Counter(
            "graftlm_engine_forwards",
            "Model forwards of the engine's steps: a prefill batch, a decode batch",
            ["kind"],
            registry=r,
        )
        self.prefill_tokens = Counter(
            "graftlm_engine_prefill_tokens",
            "Prompt tokens prefilled ('prompt') and computed with the rows' padding ('computed')",
            ["kind"],
            registry=r,
        )
        self.decode_rows = Counter(
            "graftlm_engine_decode_rows", "Decode rows of the steps (one token each)", registry=r
        )
        self.step_cpu = Counter(
            "graftlm_engine_step_cpu_seconds",
            "CPU time of the engine thread in steps (with one thread: all of their compute)",
            registry=r,
        )
        self.step_wall = Counter(
            "graftlm_engine_step_seconds", "Wall time of the engine's steps", registry=r
        )

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Requests, tokens and errors, the queue, the batch, latencies."""
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
        self.slow_clients = Counter(
            "graftlm_slow_clients",
            "Streams ended because the client read nothing for the write timeout (-to)",
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

    def _adapter_metrics(self, r: CollectorRegistry) -> None:
        """Adapters attached, their loads on first use and their bytes."""
        self.adapters_resident = Gauge(
            "graftlm_lora_adapters_resident", "LoRA adapters attached", registry=r
        )
        self.adapter_loads = Counter(
            "graftlm_lora_adapter_loads",
            "Adapters attached on first use (read and transformed), by name",
            ["adapter"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "graftlm_lora_adapter_load_seconds",
            "Seconds an adapter attached on first use took to read, check and pack (off the "
            "engine's thread) and to attach (between two steps)",
            buckets=_ATTACH,
            registry=r,
        )
        self.adapter_wait_seconds = Histogram(
            "graftlm_lora_adapter_wait_seconds",
            "Seconds an adapter attached on first use waited for room under --max-loras / "
            "--max-lora-memory (adapters of running requests stay), or for other adapters' "
            "reads and attaches ahead of it",
            buckets=_LATENCY,
            registry=r,
        )
        self.adapter_bytes = Gauge(
            "graftlm_lora_adapter_bytes", "Bytes held by attached LoRA adapters", registry=r
        )
        self.adapter_queue = Gauge(  # (read when scraped: `set_function`)
            "graftlm_lora_requests_waiting",
            "Requests waiting for their adapters: to be read, for room under --max-loras / "
            "--max-lora-memory (adapters of running requests stay), to be attached, or held "
            "back by a request waiting for room; runtime loads and a router's warms among them",
            registry=r,
        )

    def _cache_metrics(self, r: CollectorRegistry) -> None:
        """The paged KV cache and its prefix cache."""
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

    # -- ServiceObserver --
    def on_step(self, rows: int, running: int, waiting: int) -> None:
        if rows > 0:
            self.batch_size.observe(rows)
            self.llama.decode(rows)
        self.running.set(running)
        self.waiting.set(waiting)
        self.llama.running, self.llama.waiting = running, waiting

    def on_work(self, work: StepWork) -> None:
        if work.prefill_rows:
            self.forwards.labels("prefill").inc()
            self.prefill_tokens.labels("prompt").inc(work.prefill_tokens)
            self.prefill_tokens.labels("computed").inc(work.prefill_padded)
        if work.decode_rows:
            self.forwards.labels("decode").inc()
            self.decode_rows.inc(work.decode_rows)
        self.step_cpu.inc(work.cpu_s)
        self.step_wall.inc(work.wall_s)

    def on_cache(self, facts: CacheFacts) -> None:
        self.kv_blocks.labels("total").set(facts.blocks_total)
        self.kv_blocks.labels("used").set(facts.blocks_used)
        self.kv_blocks.labels("cached").set(facts.blocks_cached)
        self.kv_block_tokens.set(facts.block_tokens)
        self.kv_bytes.set(facts.nbytes)
        now = (facts.query_tokens, facts.hit_tokens, facts.evicted)
        counters = (self.prefix_queries, self.prefix_hits, self.prefix_evictions)
        for counter, n, seen in zip(counters, now, self._seen, strict=True):
            # a cache made anew (the engine woken from sleep) counts from 0 again: all of its
            # count is new, where the difference would be negative and refused
            counter.inc(n - seen if n >= seen else n)
        self._seen = now

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

    def adapter_loaded(self, name: str, load: float, wait: float) -> None:
        self.adapter_loads.labels(name).inc()
        self.adapter_load_seconds.observe(load)
        self.adapter_wait_seconds.observe(wait)

    def adapters(self, resident: int, nbytes: int) -> None:
        self.adapters_resident.set(resident)
        self.adapter_bytes.set(nbytes)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry) + self.llama.render(), CONTENT_TYPE_LATEST


class LlamaMetrics:
    """llama-server's `llamacpp:*` metrics, written in its exposition (`n_tokens_max` is a counter
    without the `_total` suffix there, which prometheus_client cannot declare)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0  # computed, not served by the prefix cache
        self.prompt_cached = 0
        self.prompt_seconds = 0.0
        self.predicted = 0
        self.predicted_seconds = 0.0
        self.n_decode = 0
        self.busy_rows = 0
        self.n_tokens_max = 0
        self.running = 0
        self.waiting = 0
        self.drafts = 0  # speculative decoding, over finished requests
        self.drafted = 0
        self.draft_accepted = 0
        # as llama-server, the throughput gauges are over what finished since the last scrape:
        # the four totals as that scrape saw them
        self._scraped: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)

    def decode(self, rows: int) -> None:
        with self._lock:
            self.n_decode += 1
            self.busy_rows += rows

    def finished(self, f: FinishEvent) -> None:
        with self._lock:
            self.prompt_tokens += f.n_prompt - f.n_cached
            self.prompt_cached += f.n_cached
            first = f.t_first or f.t_end or f.t_submit
            self.prompt_seconds += max(0.0, first - f.t_submit)
            self.predicted += f.n_generated
            self.predicted_seconds += max(0.0, (f.t_end or first) - first)
            self.n_tokens_max = max(self.n_tokens_max, f.n_prompt + f.n_generated)
            self.drafts += f.n_drafts
            self.drafted += f.n_drafted
            self.draft_accepted += f.n_draft_accepted

    def prompt_only(self, n_tokens: int, seconds: float) -> None:
        """A request that only reads its prompt (embeddings)."""
        with self._lock:
            self.prompt_tokens += n_tokens
            self.prompt_seconds += seconds
            self.n_decode += 1
            self.n_tokens_max = max(self.n_tokens_max, n_tokens)

    def render(self) -> bytes:
        """The exposition; the throughput gauges' window starts again (llama-server's buckets)."""
        with self._lock:
            window = self._window()
            rows_of = [
                (kind, name, text, window[key] if key in window else getattr(self, key))
                for kind, name, text, key in _LLAMA_EXPOSITION
            ]
        out = []
        for kind, name, help_text, value in rows_of:
            out += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}"]
            out.append(f"llamacpp:{name} {float(value):g}")
        return ("\n".join(out) + "\n").encode()

    def _window(self) -> dict[str, float]:
        """The gauges computed at a scrape (the lock held): throughputs since the last scrape,
        busy rows per step."""
        now = (self.prompt_tokens, self.prompt_seconds, self.predicted, self.predicted_seconds)
        n_p, t_p, n_g, t_g = (a - b for a, b in zip(now, self._scraped, strict=True))
        self._scraped = now
        return {
            "prompt_rate": n_p / t_p if t_p else 0.0,
            "predicted_rate": n_g / t_g if t_g else 0.0,
            "busy_per_decode": self.busy_rows / self.n_decode if self.n_decode else 0.0,
        }


# llama-server's metrics in its order: (type, name, help, LlamaMetrics' value: an attribute, or one
# of `_window`'s)
_LLAMA_EXPOSITION = (
    ("counter", "prompt_tokens_total", "Number of prompt tokens processed.", "prompt_tokens"),
    (
        "counter",
        "prompt_tokens_cached_total",
        "Prompt tokens served by the prefix cache.",
        "prompt_cached",
    ),
    ("counter", "prompt_seconds_total", "Prompt process time", "prompt_seconds"),
    ("counter", "tokens_predicted_total", "Number of generation tokens processed.", "predicted"),
    ("counter", "tokens_predicted_seconds_total", "Predict process time", "predicted_seconds"),
    ("counter", "n_decode_total", "Total number of engine steps.", "n_decode"),
    ("counter", "n_tokens_max", "Largest observed n_tokens.", "n_tokens_max"),
    (
        "counter",
        "spec_decode_num_draft_tokens_total",
        "Tokens drafted by speculative decoding (of finished requests).",
        "drafted",
    ),
    (
        "counter",
        "spec_decode_num_accepted_tokens_total",
        "Drafted tokens accepted (of finished requests).",
        "draft_accepted",
    ),
    (
        "counter",
        "spec_decode_num_drafts_total",
        "Drafts verified (of finished requests).",
        "drafts",
    ),
    (
        "gauge",
        "prompt_tokens_seconds",
        "Average prompt throughput in tokens/s, since the last scrape.",
        "prompt_rate",
    ),
    (
        "gauge",
        "predicted_tokens_seconds",
        "Average generation throughput in tokens/s, since the last scrape.",
        "predicted_rate",
    ),
    ("gauge", "requests_processing", "Number of requests processing.", "running"),
    ("gauge", "requests_deferred", "Number of requests deferred.", "waiting"),
    (
        "gauge",
        "n_busy_slots_per_decode",
        "Average number of busy slots per engine step.",
        "busy_per_decode",
    ),
)
