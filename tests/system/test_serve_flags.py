"""Size flags of ``kvstore serve`` reach what they set, read as written: a real server
(tiny-llama) started with ``--max-body-bytes 1K --memory-floor 4G``.

Issue 52.14: with either flag ignored or misread (a server started with ``1K`` served a
3,064-byte body; ``4G`` read as 4 MiB) every test still passed, because only the defaults
were tested.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.servers import Server

LIMIT = 1024  # --max-body-bytes 1K


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tools.testing.model_builds import model_path

    tmp = tmp_path_factory.mktemp("flags")
    with Server(model_path("tiny-llama"), tmp / "cache", tmp / "log",
                ["--max-body-bytes", "1K", "--memory-floor", "4G"]) as s:
        yield s


def body_of(size: int, max_tokens: int = 1) -> bytes:
    """A chat body of exactly ``size`` bytes (its user message padded with letters)."""
    def make(pad: int) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "Name a colour." + " a" * pad}],
                           "max_tokens": max_tokens, "temperature": 0}).encode()
    bare = len(make(0))
    assert size >= bare + 1, size
    raw = make((size - bare) // 2)
    if len(raw) < size:  # an odd remainder: one more space
        raw = raw.replace(b"Name a colour.", b"Name a colour. ", 1)
    assert len(raw) == size, (len(raw), size)
    return raw


def post(server: Server, path: str, raw: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(server.url + path, data=raw, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_max_body_bytes_1k_refuses_a_larger_body_and_serves_a_smaller_one(server: Server) -> None:
    """A 3,064-byte body (and one byte over 1 KiB) is a 413 naming the limit and the flag, on
    the OpenAI and the Anthropic routes; nothing of it is looked up or stored; a 900-byte
    body and one of exactly 1,024 bytes are served."""
    before = server.stats()
    for size in (3064, LIMIT + 1):
        for path in ("/v1/chat/completions", "/v1/messages"):
            raw = body_of(size) if path.endswith("completions") else json.dumps(
                {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * size}]}).encode()
            status, got = post(server, path, raw)
            assert status == 413, (path, size, status, got)
            message = got["error"]["message"]
            assert f"{len(raw):,}" in message and f"limit of {LIMIT:,}" in message, message
            assert "--max-body-bytes" in message, message
    after = server.stats()
    for key in ("misses", "hits_memory", "memory_entries", "writes"):
        assert after[key] == before[key], (key, before[key], after[key])  # refused: nothing looked up or kept
    for size in (900, LIMIT):
        status, got = post(server, "/v1/chat/completions", body_of(size))
        assert status == 200 and got["choices"][0]["message"]["content"] is not None, (size, status, got)
    assert server.stats()["misses"] > before["misses"]  # those were served: looked up


def test_memory_floor_4g_is_four_gibibytes(server: Server) -> None:
    """``--memory-floor 4G`` reaches the memory tier's gauge as 4 GiB (its stats say the floor
    it keeps free), through the CLI's parse, the adapter and the store."""
    stats = server.stats()
    assert stats["memory_floor_bytes"] == 4 << 30, stats.get("memory_floor_bytes")
    assert stats["memory_available_bytes"] > 0, stats
