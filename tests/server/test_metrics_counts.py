"""The prefix cache's counters in /metrics follow the cache's own running counts, also across a
cache made anew (the engine put to sleep and woken), whose counts restart at 0."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from graftlm.runtime.events import CacheFacts
from graftlm.server.metrics import Metrics


def _facts(queries: int, hits: int, evicted: int) -> CacheFacts:
    return CacheFacts(8, 2, 1, 16, 4096, queries, hits, evicted)


def _value(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name)
    assert value is not None, name
    return value


def test_prefix_counters_add_the_new_counts_and_survive_a_fresh_cache() -> None:
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.on_cache(_facts(100, 40, 2))
    metrics.on_cache(_facts(150, 60, 3))
    assert _value(registry, "graftlm_prefix_cache_queries_total") == 150
    metrics.on_cache(_facts(30, 10, 0))  # a new cache after waking: its counts start again
    assert _value(registry, "graftlm_prefix_cache_queries_total") == 180
    assert _value(registry, "graftlm_prefix_cache_hits_total") == 70
    assert _value(registry, "graftlm_prefix_cache_evictions_total") == 3
    metrics.on_cache(_facts(50, 10, 1))
    assert _value(registry, "graftlm_prefix_cache_queries_total") == 200
    assert _value(registry, "graftlm_prefix_cache_evictions_total") == 4


def test_step_work_adds_up_in_the_engine_counters() -> None:
    from graftlm.runtime.events import StepWork

    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.on_work(StepWork(2, 50, 60, 2, 0.5, 0.7))  # two prompts end, their rows decode
    metrics.on_work(StepWork(0, 0, 0, 2, 0.25, 0.3))
    v = registry.get_sample_value
    assert v("graftlm_engine_forwards_total", {"kind": "prefill"}) == 1
    assert v("graftlm_engine_forwards_total", {"kind": "decode"}) == 2
    assert v("graftlm_engine_prefill_tokens_total", {"kind": "prompt"}) == 50
    assert v("graftlm_engine_prefill_tokens_total", {"kind": "computed"}) == 60
    assert _value(registry, "graftlm_engine_decode_rows_total") == 4
    assert _value(registry, "graftlm_engine_step_cpu_seconds_total") == 0.75
    assert _value(registry, "graftlm_engine_step_seconds_total") == 1.0
