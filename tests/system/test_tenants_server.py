"""Tenants of ``kvstore serve`` over real HTTP: real server processes (tiny-llama), a real
redis-server, the official ``openai`` and ``anthropic`` clients.

- Tenant A's long system prompt is stored; tenant B sending the same prompt under another
  ``cache_salt`` (or, with ``--isolate-keys``, another key) gets 0 cached tokens, in memory,
  from disk after a restart, and through Redis on a second server; A still hits in all
  three. Both of mlx_lm.server's generation paths are run (batched, and the single path a
  request with a ``seed`` takes).
- A timing probe: B's time to first token for A's prefix is a cold prefill's, not a hit's.
- Keys: every endpoint but ``/health`` answers 401 in its API's own error shape without a
  valid key (Bearer or x-api-key); an over-long salt is a 400 naming ``cache_salt``; after
  those refusals nothing is stored. A non-loopback ``--host`` without a key is warned about.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anthropic
import openai
import pytest

from tests.support.servers import Server

if TYPE_CHECKING:
    from tests.support.redis_servers import RedisServer

pytest_plugins = ("tests.support.redis_servers",)

SYSTEM = " ".join(f"Rule {i}: answer like a careful librarian and cite section {i * 7 % 31} of the charter."
                  for i in range(30))  # ~2,000 tokens for the byte-level tokenizer
OTHER = SYSTEM.replace("librarian", "navigator")  # same length, another prompt
QUESTION = "Which section does rule 3 cite?"
KEYS = {"A": "key-tenant-a-0001", "B": "key-tenant-b-0002", "C": "key-tenant-c-0003", "D": "key-tenant-d-0004"}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tools.testing.model_builds import model_path

    return model_path("tiny-llama")


def messages(system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]


def call(server: Server, method: str, path: str, body: Any = None, *, key: str | None = None,
         header: str = "Authorization", timeout: float = 120) -> tuple[int, Any]:
    """(status, parsed JSON or text) of one request, any status."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[header] = f"Bearer {key}" if header == "Authorization" else key
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def chat(server: Server, *, key: str | None = None, salt: str | None = None, system: str = SYSTEM,
         **extra: Any) -> int:
    """Cached tokens of one chat completion (asserting it succeeded)."""
    body: dict[str, Any] = {"messages": messages(system), "max_tokens": 2, "temperature": 0, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    status, got = call(server, "POST", "/v1/chat/completions", body, key=key)
    assert status == 200, (status, got, server.log())
    return got["usage"]["prompt_tokens_details"]["cached_tokens"]


def stats(server: Server, key: str | None = None, salt: str | None = None) -> dict[str, Any]:
    """/v1/cache/stats as ``key`` reads it; ``salt``: the counts of that cache_salt's lookups."""
    status, got = call(server, "GET", "/v1/cache/stats" + (f"?cache_salt={salt}" if salt else ""), key=key)
    assert status == 200, (status, got)
    return got


def flushed(server: Server, key: str | None = None, timeout: float = 60) -> dict[str, Any]:
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        s = stats(server, key)
        now = (s.get("queue_depth"), s.get("writes"), s.get("shared_publish_queue"), s.get("shared_published"))
        if s.get("queue_depth") == 0 and s.get("writes", 0) >= 1 and not s.get("shared_publish_queue") and now == last:
            return s
        last = now
        time.sleep(0.3)
    raise AssertionError(f"not flushed: {stats(server, key)}")


# tenant -> request options, per way of telling tenants apart
def tenant(mode: str, who: str) -> dict[str, Any]:
    if mode == "salt":
        return {"salt": f"tenant-{who}-salt"}
    return {"key": KEYS[who]}


def extra_flags(mode: str) -> list[str]:
    if mode == "salt":
        return []
    return [f for k in KEYS.values() for f in ("--api-key", k)] + ["--isolate-keys"]


@pytest.mark.parametrize("mode", ["salt", "keys"])
def test_tenants_never_share_in_memory_on_disk_or_through_redis(mode: str, model_dir: Path, tmp_path: Path,
                                                                 redis_server: RedisServer) -> None:
    shared = ["--shared", redis_server.url, "--shared-timeout", "1000"]
    if mode == "salt":  # this fleet signs its shared values (kvstore.shared.signing); the other does not
        (tmp_path / "secret").write_bytes(b"fleet-secret-for-the-salt-run\n")
        shared += ["--shared-secret-file", str(tmp_path / "secret")]
    admin = KEYS["A"] if mode == "keys" else None
    a, b, c, d = (tenant(mode, w) for w in "ABCD")
    with Server(model_dir, tmp_path / "one", tmp_path / "one.log", [*shared, *extra_flags(mode)]) as s:
        assert chat(s, **a) == 0
        assert chat(s, **a) > 1000                      # A's hit, from memory
        assert chat(s, **b) == 0                        # B: another salt / key, not even partly
        assert chat(s, **b, seed=0) > 1000              # B's own entry, on the single path
        assert chat(s, **c, seed=0) == 0                # the single path keeps tenants apart too
        assert chat(s, **a, seed=0) > 1000
        if mode == "salt":
            assert chat(s) == 0                         # no salt never finds a salted entry
        flushed(s, admin)
        assert s.stop(signal.SIGTERM) == 0
    with Server(model_dir, tmp_path / "one", tmp_path / "two.log", extra_flags(mode)) as s:  # restart: disk
        assert chat(s, **d) == 0
        assert chat(s, **a) > 1000
        got = stats(s, admin, a.get("salt"))  # A's own lookups (kvstore.callers)
        assert got["hits_disk"] >= 1 and got["hits_memory"] == 0, got
        assert "responses" not in got, got  # they count every tenant's stored responses
        if mode == "salt":
            assert "responses" in stats(s), "the unsalted view keeps the stored responses' counters"
    with Server(model_dir, tmp_path / "three", tmp_path / "three.log", [*shared, *extra_flags(mode)]) as s:
        assert chat(s, **d) == 0                        # a fresh machine: Redis holds A's, B's and C's
        assert chat(s, **a) > 1000
        got = stats(s, admin, a.get("salt"))
        assert got["hits_shared"] == 1 and got["shared_lookups"] >= 2, got
        assert got["shared_rejected"] == 0 and got["shared_bad_signature"] == 0, got
    if mode == "salt":  # every value the fleet published is signed: a store without the secret finds none
        from kvstore.shared import values
        from kvstore.shared.signing import TAG_BYTES

        with redis_server.client() as rc:
            names = [n for n in rc.scan_iter("kvstore:*:e1:*")]
            assert names and all(values.parse_frame(rc.get(n)).size + TAG_BYTES == rc.strlen(n) for n in names)


def test_a_hit_is_not_observable_across_salts(model_dir: Path, tmp_path: Path) -> None:
    """The timing probe: B's one-token completion for A's prefix is a cold prefill, not A's
    hit. Each B probe uses a salt of its own (so it never meets its own earlier entry); the
    cold reference is prompts nobody sent before. Asserted on what the server did (cached
    tokens, each salt's own lookup counts), not on the times, which are printed: a loaded
    machine makes any run slow."""
    def ttft(**kw: Any) -> tuple[float, int]:
        t0 = time.perf_counter()
        n = chat(s, max_tokens=1, **kw)
        return time.perf_counter() - t0, n

    with Server(model_dir, tmp_path / "c", tmp_path / "log") as s:
        runs = {"cold": [ttft(salt="A")]}
        runs["hit"] = [ttft(salt="A") for _ in range(3)]
        runs["probe"] = [ttft(salt=f"B{i}") for i in range(3)]
        runs["cold"] += [ttft(salt="cold-1", system=OTHER), ttft(salt="cold-2", system=OTHER.replace("charter", "act"))]
        tallies = {salt: stats(s, salt=salt) for salt in ["A"] + [f"B{i}" for i in range(3)]}
    assert all(n == 0 for _, n in runs["cold"] + runs["probe"]), runs  # cold runs and probes: nothing cached
    assert all(n > 1000 for _, n in runs["hit"]), runs
    for i in range(3):  # each probe's own lookup: one miss, nothing restored from any tier
        t = tallies[f"B{i}"]
        assert (t["misses"], t["hits_memory"], t["hits_disk"], t["tokens_saved"]) == (1, 0, 0, 0), t
    assert tallies["A"]["hits_memory"] == 3 and tallies["A"]["misses"] == 1, tallies["A"]
    t = {k: [round(x, 3) for x, _ in v] for k, v in runs.items()}
    print(f"\nTTFT (s): cold {t['cold']}, A's hits {t['hit']}, B's probes {t['probe']}")


def test_keys_guard_every_endpoint_but_health(model_dir: Path, tmp_path: Path) -> None:
    key = KEYS["A"]
    with Server(model_dir, tmp_path / "c", tmp_path / "log", ["--api-key", key, "--host", "0.0.0.0"]) as s:
        assert "without an API key" not in s.log(1 << 20)
        assert call(s, "GET", "/health")[0] == 200
        for method, path in [("GET", "/v1/cache/stats"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("GET", "/nowhere"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]:
            body = {"messages": messages(), "max_tokens": 2} if method == "POST" else None
            for bad in (None, "wrong-key"):
                status, got = call(s, method, path, body, key=bad)
                assert status == 401, (path, status, got)
                assert got["error"]["type"] == "authentication_error" and got["error"]["code"] == "invalid_api_key"
                assert ("missing" in got["error"]["message"]) == (bad is None), got
        for bad in (None, "wrong-key"):  # Anthropic's shape on its own API
            status, got = call(s, "POST", "/v1/messages", {"model": "m", "max_tokens": 2, "messages": messages()[1:]},
                               key=bad, header="x-api-key")
            assert status == 401 and got["type"] == "error" and got["error"]["type"] == "authentication_error", got
        status, got = call(s, "POST", "/v1/chat/completions", {"messages": messages(), "max_tokens": 2,
                                                               "cache_salt": "x" * 257}, key=key)
        assert status == 400 and got["error"]["param"] == "cache_salt" and "256" in got["error"]["message"], got
        for bad_salt in ("", 12, None, ["a"]):
            status, got = call(s, "POST", "/v1/chat/completions", {"messages": messages(), "max_tokens": 2,
                                                                   "cache_salt": bad_salt}, key=key)
            assert status == 400 and got["error"]["param"] == "cache_salt", (bad_salt, got)
        status, got = call(s, "POST", "/v1/messages", {"model": "m", "max_tokens": 2, "messages": messages()[1:],
                                                       "cache_salt": "y" * 300}, key=key, header="x-api-key")
        assert status == 400 and got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
        got = stats(s, key)  # nothing refused reached the cache
        assert got["memory_entries"] == 0 and got.get("writes", 0) == 0 and got["misses"] == 0, got
        assert key not in s.log(1 << 20)
        assert call(s, "GET", "/v1/models", key=key, header="x-api-key")[0] == 200
        assert chat(s, key=key) == 0 and chat(s, key=key) > 1000


def test_a_public_host_without_a_key_is_warned_about(model_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    with Server(model_dir, tmp_path / "c", tmp_path / "log", ["--host", "0.0.0.0"]) as s:
        assert "listening on 0.0.0.0 without an API key" in s.log(1 << 20)
        assert call(s, "GET", "/v1/cache/stats")[0] == 200  # no key configured: nothing checked
    monkeypatch.setenv("KVSTORE_API_KEYS", "env-key-one, env-key-two")
    with Server(model_dir, tmp_path / "c", tmp_path / "log2", ["--host", "0.0.0.0"]) as s:
        assert "without an API key" not in s.log(1 << 20)
        assert call(s, "GET", "/v1/cache/stats")[0] == 401
        assert call(s, "GET", "/v1/cache/stats", key="env-key-two")[0] == 200
        assert call(s, "GET", "/v1/cache/stats", key="env-key-two", header="x-api-key")[0] == 200


def test_official_clients_with_and_without_a_key(model_dir: Path, tmp_path: Path) -> None:
    key = KEYS["B"]
    with Server(model_dir, tmp_path / "c", tmp_path / "log", ["--api-key", key]) as s:
        base = s.url + "/v1"
        for wrong in ("not-the-key", ""):
            c = openai.OpenAI(base_url=base, api_key=wrong or "x", max_retries=0, timeout=60,
                              default_headers={"Authorization": ""} if not wrong else None)
            with pytest.raises(openai.AuthenticationError) as e:
                c.chat.completions.create(model=str(model_dir), messages=messages(), max_tokens=2)  # type: ignore[arg-type]
            assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        c = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as bad:
            c.chat.completions.create(model=str(model_dir), messages=messages(), max_tokens=2,  # type: ignore[arg-type]
                                      extra_body={"cache_salt": "z" * 1000})
        assert bad.value.param == "cache_salt"
        assert stats(s, key)["memory_entries"] == 0  # refused: nothing stored
        for expect in (0, 1000):
            r = c.chat.completions.create(model=str(model_dir), messages=messages(), max_tokens=2,  # type: ignore[arg-type]
                                          temperature=0, extra_body={"cache_salt": "team-1"})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            cached = r.usage.prompt_tokens_details.cached_tokens or 0
            assert cached > expect if expect else cached == 0
        r = c.chat.completions.create(model=str(model_dir), messages=messages(), max_tokens=2,  # type: ignore[arg-type]
                                      temperature=0, extra_body={"cache_salt": "team-2"})
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
        assert [m.id for m in c.models.list().data] == [str(model_dir)]

        ac = anthropic.Anthropic(base_url=s.url, api_key="not-the-key", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as ae:
            ac.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": QUESTION}])
        assert ae.value.status_code == 401 and ae.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        ac = anthropic.Anthropic(base_url=s.url, api_key=key, max_retries=0, timeout=120)
        with pytest.raises(anthropic.BadRequestError) as ab:
            ac.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": QUESTION}],
                               extra_body={"cache_salt": "w" * 257})
        assert ab.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "cache_salt" in ab.value.body["error"]["message"]  # type: ignore[index]
        try:  # the key is accepted; /v1/messages itself is kvstore.serve.anthropic's (another change)
            ac.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": QUESTION}])
        except anthropic.NotFoundError:
            pass
    with Server(model_dir, tmp_path / "c", tmp_path / "log2") as s:  # no --api-key: any key, or none
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="anything", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=str(model_dir), messages=messages(), max_tokens=2,  # type: ignore[arg-type]
                                      extra_body={"cache_salt": "team-1"})
        assert r.usage.prompt_tokens_details.cached_tokens > 1000  # type: ignore[union-attr]  # team-1's, from disk
        r = c.chat.completions.create(model=str(model_dir), messages=messages(), max_tokens=2)  # type: ignore[arg-type]
        assert r.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
        assert call(s, "GET", "/v1/cache/stats")[0] == 200
