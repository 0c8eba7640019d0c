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
