"""``GET /metrics``: a real ``kvstore serve`` scraped, parsed with prometheus-client's own
parser, every figure checked against ``/v1/cache/stats`` read right after it.

The first server answers a chat (misses, writes: persist histogram) and a follow-up that
reuses it from memory; it is stopped, and a second server on the same directory answers
the follow-up from disk (a disk hit: restore histogram, bytes read).
"""

from __future__ import annotations

import signal
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import Server, reply

SYSTEM = " ".join(f"Rule {i}: answer like a careful archivist and cite section {i * 7 % 31}." for i in range(8))


def scrape(s: Server) -> tuple[dict[tuple[str, tuple], float], str]:
    """{(sample name, sorted labels): value} of one scrape, and its Content-Type."""
    with urllib.request.urlopen(s.url + "/metrics", timeout=10) as r:
        assert r.status == 200
        ctype, text = r.headers["Content-Type"], r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("kvstore_"), fam.name
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out, ctype


def check_against_stats(m: dict, st: dict) -> None:
    for tier in ("memory", "disk", "shared"):
        assert m[("kvstore_hits_total", (("tier", tier),))] == st[f"hits_{tier}"]
        assert m[("kvstore_restored_tokens_total", (("tier", tier),))] == st[f"tokens_{tier}"]
    assert sum(m[("kvstore_restored_tokens_total", (("tier", t),))] for t in ("memory", "disk", "shared")) \
        == st["tokens_saved"]
    assert m[("kvstore_misses_total", ())] == st["misses"]
    assert m[("kvstore_read_bytes_total", (("tier", "disk"),))] == st["bytes_read"]
    assert m[("kvstore_written_bytes_total", (("tier", "disk"),))] == st["bytes_written"]
    assert m[("kvstore_writes_total", ())] == st["writes"]
    assert m[("kvstore_evictions_total", (("tier", "memory"),))] == st["evictions_memory"]
    for kind in ("corrupt", "io_errors", "write_errors", "dropped_writes"):
        assert m[("kvstore_errors_total", (("kind", kind),))] == st[kind]
    assert m[("kvstore_disk_entries", ())] == st["disk_entries"]
    assert m[("kvstore_memory_bytes", ())] == st["memory_bytes"]
    assert m[("kvstore_preloaded_entries", ())] == st["preloaded_entries"]
    for name, count in (("restore", "restores"), ("persist", "writes")):
        h = st[f"{name}_seconds_histogram"]
        assert m[(f"kvstore_{name}_seconds_count", ())] == h["count"] == st[count]
        assert m[(f"kvstore_{name}_seconds_bucket", (("le", "+Inf"),))] == h["count"]
        assert m[(f"kvstore_{name}_seconds_sum", ())] == pytest.approx(h["sum"])
        for le, c in zip(h["le"], h["counts"]):
            assert m[(f"kvstore_{name}_seconds_bucket", (("le", repr(float(le))),))] == c


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def test_metrics_match_the_stats_across_a_restart(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise the rules."}]
    with Server(model_dir, cache, tmp_path / "s1.log") as s:
        m, ctype = scrape(s)  # before any request: every counter is there, at zero
        assert ctype.startswith("text/plain") and "version=0.0.4" in ctype, ctype
        assert m[("kvstore_hits_total", (("tier", "disk"),))] == 0 and m[("kvstore_misses_total", ())] == 0
        answer, _ = reply(s.chat(turn1))
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And rule 3?"}]
        s.chat(turn2)
        st = s.wait_flushed()
        m, _ = scrape(s)
        assert st["writes"] >= 1 and st["misses"] >= 1 and st["hits_memory"] >= 1, st
        check_against_stats(m, s.stats())
        assert s.stop(signal.SIGTERM) == 0
    # the write policy's flags reach the store; what they skip is counted on both sides
    with Server(model_dir, cache, tmp_path / "s2.log", ["--persist", "system", "--max-write-bytes-per-day", "1G"]) as s:
        s.chat(turn2)
        st = settled(s)
        m, _ = scrape(s)
        assert st["hits_disk"] >= 1 and st["restores"] >= 1 and st["bytes_read"] > 0, st
        assert st["persist_policy"] == "system" and st["max_write_bytes_per_day"] == 1 << 30, st
        assert st["writes_skipped_policy"] >= 1, st  # the conversation: not a system segment
        check_against_stats(m, s.stats())
        assert m[("kvstore_writes_skipped_total", (("reason", "policy"),))] == st["writes_skipped_policy"]
        assert m[("kvstore_written_today_bytes", ())] == st["written_today_bytes"] > 0


def settled(s: Server) -> dict:
    """The stats once the writer has nothing queued or running, twice in a row."""
    last = None
    for _ in range(300):
        st = s.stats()
        now = (st["pending_writes"], st["writes"], st["writes_skipped_policy"])
        if st["pending_writes"] == 0 and now == last:
            return st
        last = now
        time.sleep(0.2)
    raise AssertionError(f"the writer did not settle: {s.stats()}")


def test_shared_tier_figures_follow_its_stats(tmp_path: Path) -> None:
    """A shared tier nobody answers (connection refused): its errors, breaker state and
    skipped calls, rendered by the same collector the server uses."""
    from kvstore import KVStore
    from kvstore.metrics import exposition, registry
    from tests.support.caches import ident, rand_tokens, synth
    from tests.support.redis_servers import free_port

    model = ident("metrics-shared")
    with KVStore(tmp_path, chunk_tokens=4, shared=f"redis://127.0.0.1:{free_port()}/0") as s:
        toks = rand_tokens(12, 1)
        s.insert(model, toks, synth(toks))
        s.flush()
        for i in range(12):
            s.fetch(model, rand_tokens(12, 100 + i))  # disk misses: each asks the shared tier
        st = s.stats()
        text = exposition(registry(lambda: st))[0].decode()
    m = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
         for fam in text_string_to_metric_families(text) for smp in fam.samples}
    assert st["shared_errors"] > 0 and st["shared_breaker_opens"] >= 1, st  # failures open the breaker
    assert m[("kvstore_errors_total", (("kind", "shared"),))] == st["shared_errors"]
    assert m[("kvstore_shared_skipped_calls_total", ())] == st["shared_skipped_calls"]
    assert m[("kvstore_shared_breaker_opens_total", ())] == st["shared_breaker_opens"]
    states = {dict(k[1])["state"]: v for k, v in m.items() if k[0] == "kvstore_shared_breaker_state"}
    assert states[st["shared_breaker_state"]] == 1 and sum(states.values()) == 1, states
