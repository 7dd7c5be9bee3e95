"""kvstore.metrics: the Prometheus exposition of the miss counts."""

from __future__ import annotations

from kvstore import misses
from kvstore.misses import Miss, Misses


def test_metrics_count_reasons_and_tokens_recomputed() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore import metrics

    m = Misses()
    m.record(Miss(misses.DIVERGED, prompt=1000, served=100, at=100, stored=900))
    m.record(Miss(misses.EVICTED_UNWRITTEN, prompt=500, served=0, at=500, stored=500, detail="policy"))
    body, _ = metrics.exposition(metrics.registry(lambda: {**m.stats(), "misses": 1}))
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    by_reason = {s.labels["reason"]: s.value for s in fams["kvstore_miss_reasons"].samples
                 if s.name.endswith("_total")}
    assert by_reason == {r: (1.0 if r in ("diverged", "evicted_unwritten") else 0.0) for r in misses.REASONS}
    lost = {(s.name, s.labels.get("le")): s.value for s in fams["kvstore_miss_lost_tokens"].samples}
    assert lost[("kvstore_miss_lost_tokens_count", None)] == 2 and lost[("kvstore_miss_lost_tokens_sum", None)] == 1300
    assert lost[("kvstore_miss_lost_tokens_bucket", "1024.0")] == 2 and lost[("kvstore_miss_lost_tokens_bucket", "256.0")] == 0
