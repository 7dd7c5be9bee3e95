"""Prometheus metrics: the store's counters in Prometheus text format (``GET /metrics``).

One source of truth: every figure is read from ``KVStore.stats()`` when Prometheus
scrapes (a custom collector), so ``/metrics`` and ``/v1/cache/stats`` never disagree and
nothing on the request path updates a second set of counters. Durations need a
distribution, which a sum cannot give: ``counters.Durations`` is a small cumulative
histogram the store observes disk restores and persists into, and that ``stats()`` reports.

Names follow Prometheus conventions: ``kvstore_`` prefix, base units (seconds, bytes),
``_total`` on counters (added by prometheus-client). This module imports
prometheus-client only when metrics are rendered, so the store does not need it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from .misses import PARTS, REASONS, STATS_PREFIX

TIERS = ("memory", "disk", "shared")
ERROR_KINDS = ("corrupt", "races", "io_errors", "write_errors", "unpersistable", "dropped_writes")
GAUGES = {  # gauge name (after kvstore_) -> help; read from the stats key of the same name
    "memory_entries": "Snapshots in the memory tier",
    "memory_bytes": "Bytes the memory tier holds",
    "memory_budget_bytes": "Bytes the memory tier may hold now (the machine's available memory above the floor, "
                           "at most the configured cap)",
    "memory_available_bytes": "Memory the machine (or the container) can still give",
    "disk_bytes": "Bytes of pack files the index references",
    "disk_entries": "Entries in the disk tier",
    "write_queue_depth": "Write-behind jobs waiting",
    "written_today_bytes": "Bytes written to disk today (UTC), all processes",
    "preloaded_entries": "Entries the last preload put in memory",
    "preloaded_tokens": "Tokens the last preload put in memory",
    "preloaded_bytes": "Bytes the last preload put in memory",
    "preload_skipped": "Entries the last preload skipped",
    "preload_seconds": "How long the last preload took",
    "preload_running": "1 while a preload runs",
}
STATS_KEY = {"write_queue_depth": "queue_depth"}  # where a gauge's stats key has another name


def families(s: dict[str, Any]) -> Iterator[Any]:
    """The metric families of one ``KVStore.stats()`` dict."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def counter(name: str, doc: str, pairs: list[tuple[str, str]] | None = None, label: str = "") -> Any:
        fam = CounterMetricFamily(f"kvstore_{name}", doc, labels=[label] if pairs else None)
        if pairs:
            for value, key in pairs:
                fam.add_metric([value], float(s.get(key, 0) or 0))
        else:
            fam.add_metric([], float(s.get(name, 0) or 0))
        return fam

    def gauge(name: str, doc: str, key: str) -> Any:
        return GaugeMetricFamily(f"kvstore_{name}", doc, value=float(s.get(key, 0) or 0))

    yield counter("hits", "Lookups served, by the tier that served them", [(t, f"hits_{t}") for t in TIERS], "tier")
    yield counter("misses", "Lookups no tier could serve")
    yield counter("miss_reasons", "Lookups that served less of the prompt than a stored prefix held, by why "
                  "(kvstore.misses)", [(r, f"{STATS_PREFIX}{r}") for r in REASONS], "reason")
    yield counter("miss_parts", "Misses by the part of the request they start in: system, tools, messages, model "
                  "(identity), previous_turn (not in the store), template, unknown (kvstore.parts)",
                  [(p, f"{STATS_PREFIX}part_{p}") for p in PARTS], "part")
    yield counter("restored_tokens", "Prompt tokens restored instead of prefilled, by tier",
                  [(t, f"tokens_{t}") for t in TIERS], "tier")
    yield counter("read_bytes", "Bytes read, by tier", [("disk", "bytes_read"), ("shared", "shared_bytes_in")], "tier")
    yield counter("written_bytes", "Bytes written, by tier",
                  [("disk", "bytes_written"), ("shared", "shared_bytes_out")], "tier")
    yield counter("writes", "Entries written to disk")
    yield counter("writes_skipped", "Entries the write policy or the daily write budget kept off disk",
                  [("policy", "writes_skipped_policy"), ("budget", "writes_skipped_budget")], "reason")
    yield counter("evictions", "Entries evicted by a size budget, by tier",
                  [("memory", "evictions_memory"), ("disk", "evictions_disk")], "tier")
    yield counter("evictions_pressure", "Entries that left the memory tier because available memory fell "
                  "under the floor (each written to disk first)")
    yield counter("restores_one_pass", "Disk restores read by MLX's loader in one pass (an entry's whole copy, "
                  "or a snapshot alone in its pack)")
    yield counter("whole_copies", "Whole copies of long entries served again (kvstore.disk.whole): written, "
                  "or dropped after failing a check", [("written", "whole_copies_written"),
                                                       ("dropped", "whole_copies_dropped")], "event")
    yield counter("gc_runs", "Disk budget enforcements that removed entries")
    yield counter("gc_freed_bytes", "Bytes of pack files the disk budget freed")
    yield counter("errors", "Problems served as a miss or kept in memory only, by kind",
                  [(k, k) for k in ERROR_KINDS] + [("shared", "shared_errors")], "kind")
    yield from _histograms(s)
    yield from _shared(s)
    for name, doc in GAUGES.items():
        yield gauge(name, doc, STATS_KEY.get(name, name))


def _histograms(s: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import HistogramMetricFamily

    for name, doc in (("restore_seconds", "Time to read and rebuild a cache from disk"),
                      ("persist_seconds", "Time to write and commit one entry to disk"),
                      (f"{STATS_PREFIX}lost_tokens", "Prompt tokens recomputed that a stored prefix held, per miss "
                                                     "(kvstore.misses)")):
        h = s.get(f"{name}_histogram")
        if not h:
            continue
        buckets = [(_le(b), c) for b, c in zip(h["le"], h["counts"])] + [("+Inf", h["count"])]
        fam = HistogramMetricFamily(f"kvstore_{name}", doc)
        fam.add_metric([], buckets, sum_value=h["sum"])
        yield fam


def _le(bound: float) -> str:
    return repr(float(bound))


def _shared(s: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if "shared_breaker_state" not in s:
        return
    state = GaugeMetricFamily("kvstore_shared_breaker_state", "The shared tier's circuit breaker (1: current state)",
                              labels=["state"])
    for name in ("closed", "half-open", "open"):
        state.add_metric([name], 1.0 if s["shared_breaker_state"] == name else 0.0)
    yield state
    for key, doc in (("skipped_calls", "Shared-tier calls skipped while the breaker was open"),
                     ("breaker_opens", "Times the shared tier's breaker opened"),
                     ("round_trips", "Round trips to the shared tier"),
                     ("publish_dropped", "Publishes dropped because the publisher queue was full")):
        fam = CounterMetricFamily(f"kvstore_shared_{key}", doc)
        fam.add_metric([], float(s.get(f"shared_{key}", 0) or 0))
        yield fam


class StatsCollector:
    """A prometheus-client collector reading ``stats()`` (a ``KVStore.stats``, or None
    when no store exists yet) at every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats()
        if s is not None:
            yield from families(s)


def registry(stats: Callable[[], dict[str, Any] | None]) -> Any:
    """A prometheus-client registry holding only the store's metrics."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(StatsCollector(stats))
    return reg


def exposition(reg: Any) -> tuple[bytes, str]:
    """(body, Content-Type) of a scrape of ``reg``: Prometheus text format 0.0.4, which
    every scraper reads (prometheus-client 0.22+ calls its newer escaping 1.0.0; kvstore's
    names are plain ASCII, so the text is the same)."""
    from prometheus_client import exposition as ex

    return ex.generate_latest(reg), getattr(ex, "CONTENT_TYPE_PLAIN_0_0_4", ex.CONTENT_TYPE_LATEST)
