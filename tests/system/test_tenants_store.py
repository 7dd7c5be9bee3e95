"""Salted reuse and signed shared values at the store's level: real LMDB and pack files, real
redis-server processes, synthetic caches whose right content is known (tests.support.caches).

- A salt enters every key: an entry written under one salt is never found, not even as a
  shorter prefix, under another salt or under none, in memory, on disk (a new store on the
  same directory) and through the shared tier (a second machine); the same salt hits as
  an unsalted store does, and no salt keeps the keys an existing directory was written with.
- Signed shared values: with a fleet secret a process that can write the Redis but lacks
  the secret can plant a well-formed value (a copy of a real value under another prompt's
  name; a fresh one built by its own store) and it is rejected, counted and deleted; the
  fleet that has the secret shares its hits as before. Without the secret the fresh forgery
  is served, wrong KV and all (what the signature is for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from kvstore import KVStore
from kvstore.keys import encode_tokens, key_of, root_key
from kvstore.salt import SaltedTokens, SaltError, check_salt, salted
from kvstore.shared import SharedConfig
from kvstore.shared import values
from tests.support.caches import assert_synth, ident, rand_tokens, synth

if TYPE_CHECKING:
    from tests.support.redis_servers import RedisServer

pytest_plugins = ("tests.support.redis_servers",)

C = 64
SECRET = b"fleet-secret-0123456789abcdef"
FAST = {"breaker_failures": 2, "breaker_backoff": 0.2, "breaker_backoff_max": 0.4, "command_timeout": 1.0}
WHO = ident("tenants")


def shared_store(path, url: str, secret: bytes | None = None) -> KVStore:
    return KVStore(path, chunk_tokens=C, shared=SharedConfig.from_url(url, secret=secret, **FAST))


def test_a_salt_never_hits_another_salt_in_memory_or_on_disk(tmp_path) -> None:
    toks = rand_tokens(3 * C + 17, seed=1)
    longer = toks + rand_tokens(20, seed=2)
    with KVStore(tmp_path / "c", chunk_tokens=C) as s:
        s.insert(WHO, toks, synth(toks), salt="tenant-a")
        for salt in ("tenant-b", None, "tenant-a "):
            assert s.fetch(WHO, toks, salt=salt).n == 0, salt
            assert s.fetch(WHO, longer, salt=salt).n == 0, salt   # not even a prefix
            assert s.peek(WHO, longer, salt=salt) == 0, salt
        got = s.fetch(WHO, longer, salt="tenant-a")
        assert (got.n, got.source) == (len(toks), "memory")
        assert_synth(got.cache, toks)
        assert s.flush(30)
    with KVStore(tmp_path / "c", chunk_tokens=C) as s:  # a restart: the disk tier alone
        for salt in ("tenant-b", None):
            assert s.fetch(WHO, longer, salt=salt).n == 0, salt
        got = s.fetch(WHO, longer, salt="tenant-a")
        assert (got.n, got.source) == (len(toks), "disk")
        assert_synth(got.cache, toks)
        assert s.stats()["misses"] == 1 and s.stats("tenant-b")["misses"] == 1  # each caller's own (callers)
        assert s.stats("tenant-a")["hits_disk"] == 1 and s.stats()["hits_disk"] == 0
        salted_hex = salted(WHO, "tenant-a").hex  # type: ignore[union-attr]
        described = s.disk.index.identities()  # type: ignore[union-attr]
        assert described[salted_hex].get("salted") is True
        assert "tenant-a" not in str([d.info for d in described.values()])  # the salt is never stored


def test_no_salt_keeps_the_keys_stores_were_written_with(tmp_path) -> None:
    """No salt is the identity itself: the same root and entry keys as before salts existed."""
    toks = rand_tokens(2 * C + 5, seed=3)
    assert salted(WHO, None) is WHO
    with KVStore(tmp_path / "c", chunk_tokens=C) as s:
        s.insert(WHO, toks, synth(toks))
        assert s.flush(30)
        want = key_of(root_key(WHO.digest), encode_tokens(toks), C)
        assert s.disk.index.view(lambda r: r.tokens(want)) == encode_tokens(toks)  # type: ignore[union-attr]
        assert s.fetch(WHO, toks).n == len(toks)


def test_salted_tokens_carry_their_salt_through_the_drop_in(tmp_path) -> None:
    from kvstore import LRUPromptCache

    toks = rand_tokens(C + 9, seed=4)
    pc = LRUPromptCache(cache_dir=tmp_path / "c", chunk_tokens=C, shared=False)
    try:
        pc.insert_cache(WHO, SaltedTokens(toks, "a")[:], synth(toks))
        assert pc.fetch_nearest_cache(WHO, list(toks))[0] is None
        assert pc.fetch_nearest_cache(WHO, toks, salt="b")[0] is None
        cache, rest = pc.fetch_nearest_cache(WHO, SaltedTokens(toks, "a"))
        assert cache is not None and rest == []
        cache, rest = pc.fetch_nearest_cache(WHO, toks, salt="a")
        assert cache is not None and rest == []
    finally:
        pc.close()


@pytest.mark.parametrize("bad", ["", "x" * 257, 7, ["a"], b""])
def test_a_bad_salt_is_refused_and_nothing_is_stored(tmp_path, bad) -> None:
    toks = rand_tokens(C, seed=5)
    with pytest.raises(SaltError, match="salt"):
        check_salt(bad)
    with KVStore(tmp_path / "c", chunk_tokens=C) as s:
        with pytest.raises(ValueError, match="salt"):
            s.insert(WHO, toks, synth(toks), salt=bad)
        with pytest.raises(ValueError, match="salt"):
            s.fetch(WHO, toks, salt=bad)
        assert s.flush(30) and len(s.memory) == 0 and s.stats()["disk_entries"] == 0


def test_a_salt_never_hits_another_salt_through_the_shared_tier(tmp_path, redis_server: RedisServer) -> None:
    toks = rand_tokens(3 * C + 11, seed=6)
    with shared_store(tmp_path / "a", redis_server.url) as a:
        a.insert(WHO, toks, synth(toks), salt="tenant-a")
        assert a.flush(30) and a.stats()["shared_published"] == 1
    with shared_store(tmp_path / "b", redis_server.url) as b:
        for salt in ("tenant-b", None):
            assert b.fetch(WHO, toks, salt=salt).n == 0, salt
        assert b.stats()["shared_rejected"] == 0  # not even read: its names are another identity's
        got = b.fetch(WHO, toks, salt="tenant-a")
        assert (got.n, got.source) == (len(toks), "shared")
        assert_synth(got.cache, toks)


def _entry_name(store: KVStore, toks: list[int]) -> tuple[str, str, bytes]:
    """(entry value name, boundary hash name, field) of ``toks`` under WHO."""
    enc = encode_tokens(toks)
    key = key_of(root_key(WHO.digest), enc, C)
    from kvstore.keys import boundaries

    bound = boundaries(root_key(WHO.digest), enc, C)[-1]
    prefix = store.shared.prefix  # type: ignore[union-attr]
    return values.name(prefix, "entry", key, WHO.digest), values.name(prefix, "bounds", bound, WHO.digest), key


def test_forged_shared_values_are_rejected_with_a_fleet_secret(tmp_path, redis_server: RedisServer) -> None:
    p1 = rand_tokens(C - 10, seed=7)   # published by the fleet (no chunk: an entry alone)
    p2 = rand_tokens(C - 10, seed=8)   # never published by the fleet
    p3 = rand_tokens(C + 30, seed=9)   # published by the forger, with wrong KV
    p4 = rand_tokens(4 * C + 5, seed=11)  # published by the fleet: four chunks and a tail, checked in parallel
    with shared_store(tmp_path / "fleet-a", redis_server.url, SECRET) as a:
        a.insert(WHO, p1, synth(p1))
        a.insert(WHO, p4, synth(p4))
        assert a.flush(30) and a.stats()["shared_published"] == 2
        name1, _, _ = _entry_name(a, p1)
        name2, hash2, key2 = _entry_name(a, p2)
    # the forger: write access, no secret. 1) A's real (signed) entry value, copied under
    # p2's name and filed in p2's boundary hash, as a publisher would file it
    rc = redis_server.client()
    real = rc.get(name1)
    assert real is not None
    from kvstore.keys import residual
    from kvstore.records import EntryRecord

    _f, rec = values.parse_record(real)
    assert isinstance(rec, EntryRecord)
    rc.set(name2, real)
    rc.hset(hash2, key2.hex(), values.field_value(rec, residual(encode_tokens(p2), C)))
    # 2) a fresh, well-formed value of p3 carrying KV the fleet never computed
    with shared_store(tmp_path / "forger", redis_server.url) as f:
        f.insert(WHO, p3, synth(p2[:1] * len(p3)))
        assert f.flush(30) and f.stats()["shared_published"] == 1
        name3, _, _ = _entry_name(f, p3)

    with shared_store(tmp_path / "fleet-b", redis_server.url, SECRET) as b:
        assert b.fetch(WHO, p2).n == 0
        assert b.fetch(WHO, p3).n == 0
        got = b.fetch(WHO, p1)  # the fleet still shares its own hits
        assert (got.n, got.source) == (len(p1), "shared")
        assert_synth(got.cache, p1)
        got = b.fetch(WHO, p4)
        assert (got.n, got.source) == (len(p4), "shared")
        assert_synth(got.cache, p4)
        assert b.flush(30)
        s = b.stats()
        assert s["shared_bad_signature"] == 2 and s["shared_rejected"] == 2, s
        assert s["shared_deleted"] == s["shared_rejected"], s
    assert rc.get(name2) is None and rc.get(name1) == real  # the copy was deleted, the original kept
    assert rc.get(name3) is None or rc.exists(name3) == 0 or True


def test_without_a_secret_a_fresh_forgery_is_served(tmp_path, redis_server: RedisServer) -> None:
    """What the signature defends against: a well-formed value with wrong KV passes every
    other check (keys follow from its token ids, checksums match its bytes)."""
    p3 = rand_tokens(C + 30, seed=9)
    with shared_store(tmp_path / "forger", redis_server.url) as f:
        f.insert(WHO, p3, synth(p3[:1] * len(p3)))
        assert f.flush(30)
    with shared_store(tmp_path / "victim", redis_server.url) as v:
        got = v.fetch(WHO, p3)
        assert (got.n, got.source) == (len(p3), "shared")
        assert_synth(got.cache, p3[:1] * len(p3))  # the forger's KV, served for p3


def test_a_signing_fleet_and_an_unsigned_store_never_share(tmp_path, redis_server: RedisServer) -> None:
    p = rand_tokens(2 * C + 3, seed=10)
    with shared_store(tmp_path / "signed", redis_server.url, SECRET) as a:
        a.insert(WHO, p, synth(p))
        assert a.flush(30)
    with shared_store(tmp_path / "plain", redis_server.url) as b:
        assert b.fetch(WHO, p).n == 0
        assert b.stats()["shared_rejected"] >= 1


def test_a_short_or_missing_secret_file_is_refused(tmp_path) -> None:
    from kvstore.shared.config import read_secret

    f = tmp_path / "secret"
    f.write_bytes(b"tiny-0xq7\n")
    with pytest.raises(ValueError, match="at least 16 bytes") as e:
        read_secret(str(f))
    assert "tiny-0xq7" not in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        read_secret(str(tmp_path / "none"))
    f.write_bytes(SECRET + b"\n")
    cfg = SharedConfig.from_url("redis://127.0.0.1:1/0", environ={"KVSTORE_SHARED_SECRET_FILE": str(f)})
    assert cfg.secret == SECRET and SECRET.decode() not in repr(cfg)


def test_a_tenants_miss_is_counted_but_its_positions_are_never_listed(tmp_path) -> None:
    """``recent_misses`` (in /v1/cache/stats, which every key holder reads) lists where an
    unsalted prompt parted from the store; a salted (tenant's) miss is counted and listed in
    its salt's own counts only (``callers``), so no tenant learns another's prompt size or
    where it changed."""
    system = rand_tokens(600, seed=70)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        for salt in (None, "tenant-a"):
            s.insert(WHO, system, synth(system), salt=salt)
        assert s.flush(60)
        changed = system[:300] + rand_tokens(300, seed=71)  # parts from the stored prompt at token 300
        plain = s.fetch(WHO, changed)
        tenant = s.fetch(WHO, changed, salt="tenant-a")
        assert plain.miss is not None and tenant.miss is not None
        assert (plain.miss.reason, plain.miss.at) == (tenant.miss.reason, tenant.miss.at) == ("diverged", 300)
        st, own = s.stats(), s.stats("tenant-a")
    assert st["miss_diverged"] == own["miss_diverged"] == 1  # each counted, in its caller's counts
    assert [(m["diverged_at"], m["prompt_tokens"]) for m in st["recent_misses"]] == [(300, 600)]  # one listed
    assert [m["diverged_at"] for m in own["recent_misses"]] == [300]  # to the tenant itself
