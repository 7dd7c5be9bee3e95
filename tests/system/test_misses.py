"""Why a request missed (issue 35): ``misses.Misses``, the log line, the metrics,
``kvstore why`` against a real cache directory, and ``kvstore serve --sort-tools``.

Real components throughout: the tiny-llama model and its tokenizer (tests/support), the
real KVStore and LMDB index, ``kvstore why`` run in-process and as a subprocess, and real
``kvstore serve`` processes for the server's surfaces.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstore import misses
from kvstore.escape import visible
from kvstore.misses import Miss
from tests.support import ROOT
from tests.support.children import child_env

UUID, UUID2 = "3f2a9c1e-7d41-4d2b-9a77-0c5e8b1f2a6d", "b81d4e02-59c3-4a6e-8f1d-6e2c7a9b0d13"
DATE, DATE2 = "2026-11-25", "2026-11-26"
# These tests change a date (or a UUID) in the system prompt to see what a miss says: the
# server and `kvstore why` render as sent. By default the stable prefix moves such a date
# out of the system prompt (tests/system/test_stable_prefix.py), and there is no miss to name.
AS_SENT = ["--no-stable-prefix"]
RULES = " ".join(f"Rule {i}: keep the ledgers of shelf {i * 7 % 13} for {i + 3} years." for i in range(12))


def system(uuid: str = UUID, date: str = DATE) -> str:
    return (f"You are a coding agent working in /home/dev/sessions/{uuid}/repo. Today's date is {date}. "
            + RULES)


def openai_body(sys_text: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": sys_text},
                                         {"role": "user", "content": "Which shelf keeps ledgers for 5 years?"}],
                            "max_tokens": 4, "temperature": 0}
    if tools:
        body["tools"] = tools
    return body


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- Misses, the log line, the metrics -------------------------------------------------------


def test_log_line_shows_escaped_text_either_side() -> None:
    from kvstore.cli.inspect import tokenizer_json_decoder
    from kvstore.escape import visible
    from tokenizers import Tokenizer
    from tools.testing.model_builds import model_path

    tok = Tokenizer.from_file(str(model_path("tiny-llama") / "tokenizer.json"))
    decode = tokenizer_json_decoder(model_path("tiny-llama"))
    assert decode is not None
    prompt = tok.encode("The header says the session id is\x1b]0;x\x07" + UUID).ids
    stored = tok.encode("The header says the session id is\x1b]0;x\x07" + UUID2).ids
    at = first_difference(prompt, stored)
    miss = Miss(misses.DIVERGED, prompt=len(prompt), served=at, at=at, stored=len(stored),
                tier="disk", after=tuple(stored[at:at + 8]))
    line = misses.log_line(miss, prompt, decode)
    assert "\n" not in line and "\x1b" not in line and "\x07" not in line
    assert "miss (diverged)" in line and f"at token {at}" in line and "(disk)" in line
    before, now = misses.around(prompt, at, decode)
    assert f'"{before}" then the prompt has "{now}"' in line and now == UUID[:8]
    assert before + now == visible(decode(prompt[at - 8:at + 8]), newlines=False)
    assert f'the store "{decode(stored[at:at + 8])}"' in line
    assert "\\x1b]0;x\\x07" in before  # the terminal title sequence, shown escaped
    assert misses.log_line(miss, prompt, None).endswith(f"at token {at}")
    other = Miss(misses.OTHER_IDENTITY, prompt=2000, served=0, at=2000, stored=2000, detail="chat_template")
    assert misses.log_line(other, prompt, decode) == (
        "kvstore: miss (other_identity: chat_template): recomputed 2,000 tokens a stored prefix held; served 0 of "
        "2,000; another identity of this model holds the prefix (2,000 tokens of this prompt)")


# -- kvstore why ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def why_store(tmp_path_factory, tiny_llama) -> dict[str, Any]:
    """A cache directory holding one request's prompt (a system prompt with a UUID and a
    date), prefilled by the real model under a copy of tiny-llama's directory."""
    from mlx_lm.utils import load_tokenizer

    from kvstore import KVStore
    from kvstore.serve.prompts import request_tokens
    from tools.testing.model_builds import model_path
    from tools.testing.oracle import prefill

    base = tmp_path_factory.mktemp("why")
    mdir = base / "model"
    shutil.copytree(model_path("tiny-llama"), mdir)
    tokenizer = load_tokenizer(mdir)
    body = openai_body(system())
    tokens = request_tokens(tokenizer, body)
    store = KVStore(base / "cache", chunk_tokens=64)
    store.insert(mdir, tokens, prefill(tiny_llama[0], tokens), cache_type="assistant")
    store.close()
    return {"dir": base / "cache", "model": mdir, "tokenizer": tokenizer, "body": body, "tokens": tokens}


def why(request: Path, store: dict[str, Any], *extra: str) -> dict[str, Any]:
    from kvstore.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["why", str(request), "--model", str(store["model"]), "--cache-dir", str(store["dir"]),
                   "--json", *AS_SENT, *extra])
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


@pytest.mark.parametrize("change", ["date", "uuid"])
def test_why_names_where_a_changed_system_prompt_diverges(why_store, tmp_path, change) -> None:
    from kvstore.serve.prompts import request_tokens

    sys_text = system(date=DATE2) if change == "date" else system(uuid=UUID2)
    body = openai_body(sys_text)
    (tmp_path / "req.json").write_text(json.dumps(body))
    got = why(tmp_path / "req.json", why_store)
    at = first_difference(request_tokens(why_store["tokenizer"], body), why_store["tokens"])
    assert 0 < at < len(why_store["tokens"]) - 100
    assert got["model"]["path"] == str(why_store["model"].resolve())
    assert got["reason"] == "diverged" and got["entries"] == 1 and got["other_identities"] == []
    near = got["nearest"]
    assert near["diverges_at"] == at and near["shared_tokens"] == at and got["serves"] == at
    new, old = (DATE2, DATE) if change == "date" else (UUID2, UUID)
    # the text either side: what precedes the change, then the request's and the store's own
    assert (near["before"] + near["request_after"]) in system(**({"date": new} if change == "date" else {"uuid": new}))
    assert (near["before"] + near["stored_after"]) in system()
    assert near["request_after"] != near["stored_after"]


def test_why_the_same_request_is_served_whole(why_store, tmp_path) -> None:
    (tmp_path / "req.json").write_text(json.dumps(why_store["body"]))
    got = why(tmp_path / "req.json", why_store)
    assert got["reason"] is None and got["serves"] == len(why_store["tokens"])
    assert got["nearest"]["diverges_at"] is None


def test_why_names_a_changed_chat_template_as_another_identity(why_store, tmp_path, tiny_llama) -> None:
    """A template file is added (the same template and a comment: the prompt renders the same): the model now
    resolves to another identity, and the entries it holds are named, with the component."""
    mdir = tmp_path / "model"
    shutil.copytree(why_store["model"], mdir)
    store = dict(why_store, model=mdir)
    cfg = json.loads((mdir / "tokenizer_config.json").read_text())
    # the copy is a new directory: first store under it, then change its template
    from kvstore import KVStore
    from tools.testing.oracle import prefill

    cache = tmp_path / "cache"
    s = KVStore(cache, chunk_tokens=64)
    s.insert(mdir, why_store["tokens"], prefill(tiny_llama[0], why_store["tokens"]))
    s.close()
    (mdir / "chat_template.jinja").write_text("{# v2 #}" + cfg["chat_template"])  # what transformers reads first
    (tmp_path / "req.json").write_text(json.dumps(why_store["body"]))
    got = why(tmp_path / "req.json", dict(store, dir=cache))
    assert got["entries"] == 0 and got["serves"] == 0
    [other] = got["other_identities"]
    assert other["differs"] == ["chat_template"] and other["entries"] == 1
    assert other["shared_tokens"] == len(why_store["tokens"])
    assert got["reason"] == "other_identity" and got["detail"] == "chat_template"


def test_why_command_line_text_is_escaped_and_quick(why_store, tmp_path) -> None:
    """The command as a user runs it: a plain text file (a completion's prompt) and an
    Anthropic Messages body; control characters in the request are printed escaped."""
    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": system(date="\x1b[2J" + DATE)}],
            "messages": [{"role": "user", "content": "Which shelf keeps ledgers for 5 years?"}]}
    (tmp_path / "req.json").write_text(json.dumps(body))
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "why", str(tmp_path / "req.json"), "--model",
                        str(why_store["model"]), "--cache-dir", str(why_store["dir"]), *AS_SENT],
                       capture_output=True, text=True, timeout=120, env=child_env(), cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and "\\x1b[2J" in p.stdout, p.stdout
    assert "why         diverged: the prompt parts from the nearest stored prefix" in p.stdout, p.stdout
    assert "diverges    at token" in p.stdout
    (tmp_path / "prompt.txt").write_text("Once upon a time")
    got = why(tmp_path / "prompt.txt", why_store)
    assert got["request_tokens"] > 0 and got["reason"] is None and got["serves"] == 0


# -- kvstore serve: --sort-tools, the log line, stats and metrics -------------------------------

TOOL_NAMES = ("Read", "Bash", "Edit", "Grep")


def openai_tools(names: tuple[str, ...] = TOOL_NAMES) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "description": f"{n} a file of the repository.",
                                              "parameters": {"type": "object", "properties": {}}}} for n in names]


def anthropic_body(sys_text: str, names: tuple[str, ...] = TOOL_NAMES) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "temperature": 0, "system": sys_text,
            "tools": [{"name": n, "description": f"{n} a file of the repository.",
                       "input_schema": {"type": "object", "properties": {}}} for n in names],
            "messages": [{"role": "user", "content": "Which shelf keeps ledgers for 5 years?"}]}


def cached(resp: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, prompt tokens restored) of a chat completion or a Messages reply."""
    u = resp["usage"]
    if "input_tokens" in u:
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "as-sent"])
def test_sort_tools_makes_reordered_tools_hit(tmp_path, sort) -> None:
    """The same request with its tools in another order: with --sort-tools it is served
    whole from the cache (both APIs); without, it is served only up to the tool list."""
    from benchmarks.agent_session import TOOL_TEMPLATE
    from tests.support.servers import Server
    from tools.testing.model_builds import model_path

    extra = ["--chat-template", TOOL_TEMPLATE] + (["--sort-tools"] if sort else [])
    with Server(model_path("tiny-llama"), tmp_path / "cache", tmp_path / "server.log", extra) as s:
        n, hit = cached(s.post("/v1/chat/completions", openai_body(system(), openai_tools())))
        assert hit == 0
        n2, hit2 = cached(s.post("/v1/chat/completions", openai_body(system(), openai_tools(TOOL_NAMES[::-1]))))
        other = system(uuid=UUID2)  # not the prompts above, which render the same
        a, _ = cached(s.post("/v1/messages", anthropic_body(other, TOOL_NAMES[::-1])))
        a2, ahit2 = cached(s.post("/v1/messages", anthropic_body(other)))
        stats = s.stats()
    assert n2 == n and a2 == a
    if sort:
        assert hit2 >= n - 1 and ahit2 >= a - 1, (hit2, ahit2, n, a)
    else:
        assert hit2 < n - 200 and ahit2 < a - 200, (hit2, ahit2, n, a)
    json.dumps(stats)


# -- each reason produced for real, seen in the log, the stats and kvstore why ------------------


def served_request(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as ``kvstore why`` reads it (the file a user saves from a client's request)."""
    return {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")} if path == "/v1/chat/completions" \
        else body


def miss_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "kvstore: miss (" in line]


@pytest.fixture
def tool_model(tmp_path) -> Path:
    """tiny-llama with the tool-rendering chat template in its own directory (a copy whose
    template a test may change)."""
    from benchmarks.agent_session import with_tool_template
    from tools.testing.model_builds import model_path

    return with_tool_template(model_path("tiny-llama"), tmp_path / "model")


def test_reasons_for_real_date_uuid_tools_billing_header_and_template(tmp_path, tool_model) -> None:
    """One server, a base request and one change each: a date, a session UUID, the tools'
    order, a per-request header in the first system block (kept: --keep-billing-header).
    Each is a ``diverged`` miss at the token where the change starts, in the log (with the
    escaped text either side), in ``/v1/cache/stats`` and ``/metrics``, and in ``kvstore
    why``. Then the chat template file changes: the same prompt under another identity is
    ``other_identity`` naming the component, in the log, the stats and ``why``."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.serve.prompts import request_tokens
    from tests.support.servers import Server

    tokenizer = load_tokenizer(tool_model)
    esc = "\x1b[1m"  # a control character just before the date: the log shows it escaped
    day, day2 = esc + "25 November 2026", esc + "26 November 2026"
    base_sys = system(date=day)
    billing = "x-anthropic-billing-header: cc_version=2.0.1; cch={};"
    changes = {
        "date": ("/v1/chat/completions", openai_body(system(date=day2), openai_tools())),
        "uuid": ("/v1/chat/completions", openai_body(system(uuid=UUID2, date=day), openai_tools())),
        "tools": ("/v1/chat/completions", openai_body(base_sys, openai_tools(TOOL_NAMES[::-1]))),
        "billing": ("/v1/messages", dict(anthropic_body(base_sys), system=[
            {"type": "text", "text": billing.format("0b1c2")}, {"type": "text", "text": base_sys}])),
    }
    bases = [("/v1/chat/completions", openai_body(base_sys, openai_tools())),
             ("/v1/messages", dict(anthropic_body(base_sys), system=[
                 {"type": "text", "text": billing.format("9f8e7")}, {"type": "text", "text": base_sys}]))]
    base_tokens = {path: request_tokens(tokenizer, body, keep_billing_header=True) for path, body in bases}
    expected = {}
    for name, (path, body) in changes.items():
        toks = request_tokens(tokenizer, body, keep_billing_header=True)
        expected[name] = first_difference(toks, base_tokens[path])
        assert 300 < len(toks) - expected[name], (name, expected[name], len(toks))  # worth a log line
    cache = tmp_path / "cache"
    extra = ["--keep-billing-header", *AS_SENT]
    with Server(tool_model, cache, tmp_path / "server1.log", extra) as s:
        for path, body in bases:
            s.post(path, body)
        s.wait_flushed()
        first = s.stats()  # the second base parts from the first one early: a miss of its own
        logged = len(miss_lines(s.log(1 << 30)))
        for name, (path, body) in changes.items():
            # kvstore why first, offline, on the directory the server uses: what it holds
            (tmp_path / f"{name}.json").write_text(json.dumps(served_request(path, body)))
            got = why(tmp_path / f"{name}.json", {"model": tool_model, "dir": cache}, "--keep-billing-header")
            assert got["reason"] == "diverged" and got["nearest"]["diverges_at"] == expected[name], (name, got)
            s.post(path, body)
            s.wait_flushed()
        stats = s.stats()
        metrics_text = urlread(s.url + "/metrics")
        log = s.log(1 << 30)
        # the chat template file changes under the running server (a comment: the prompt
        # renders the same): the model resolves to another identity, whose entries the
        # memory tier still holds
        template = json.loads((tool_model / "tokenizer_config.json").read_text())["chat_template"]
        (tool_model / "chat_template.jinja").write_text("{# v2 #}" + template)
        path, body = bases[0]
        (tmp_path / "base.json").write_text(json.dumps(served_request(path, body)))
        got = why(tmp_path / "base.json", {"model": tool_model, "dir": cache})  # before it is stored again
        s.post(path, body)
        changed = s.stats()
        later = miss_lines(s.log(1 << 30))[len(miss_lines(log)):]
    assert stats["miss_diverged"] - first["miss_diverged"] == len(changes), {
        k: v for k, v in stats.items() if k.startswith("miss")}
    listed = stats["recent_misses"][len(first["recent_misses"]):]
    assert [(m["reason"], m["diverged_at"]) for m in listed] == [("diverged", at) for at in expected.values()], (
        listed, expected)
    assert not any("after" in m or "text" in m for m in listed)
    lines = miss_lines(log)[logged:]
    assert len(lines) == len(changes), log[-4000:]
    for line, at in zip(lines, expected.values()):
        assert "miss (diverged)" in line and f"at token {at:,}" in line, line
    assert "\\x1b[1m2" in lines[0] and "\x1b" not in "".join(lines), lines[0]  # the date's line: escaped
    assert f'kvstore_miss_reasons_total{{reason="diverged"}} {stats["miss_diverged"]:.1f}' in metrics_text
    assert f"kvstore_miss_lost_tokens_count {sum(stats[f'miss_{r}'] for r in misses.REASONS):.1f}" in metrics_text

    assert changed["miss_other_identity"] == 1, {k: v for k, v in changed.items() if k.startswith("miss")}
    m = changed["recent_misses"][-1]
    assert m["reason"] == "other_identity" and m["detail"] == "chat_template" and m["served_tokens"] == 0
    assert len(later) == 1 and "miss (other_identity: chat_template)" in later[0], later
    assert got["reason"] == "other_identity" and got["detail"] == "chat_template", got
    assert got["other_identities"][0]["differs"] == ["chat_template"]
    assert got["other_identities"][0]["shared_tokens"] == len(base_tokens[path])


def urlread(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_reason_evicted_unwritten(tmp_path) -> None:
    """--persist system keeps a conversation without a system prompt off the disk; a memory
    tier of one entry drops it at the next request: asked again, it is a miss the store can
    name."""
    from tests.support.servers import Server
    from tools.testing.model_builds import model_path

    a, b = openai_body(system()), openai_body(system(uuid=UUID2, date=DATE2) + " Another session.")
    a["messages"] = a["messages"][1:]  # no system segment: the whole prompt is one entry
    a["messages"][0]["content"] = system() + " " + a["messages"][0]["content"]
    b["messages"] = [{"role": "user", "content": "Something else entirely. " + RULES}]
    extra = ["--persist", "system", "--prompt-cache-size", "1"]
    with Server(model_path("tiny-llama"), tmp_path / "cache", tmp_path / "server.log", extra) as s:
        n, _ = cached(s.post("/v1/chat/completions", a))
        s.post("/v1/chat/completions", b)
        _, hit = cached(s.post("/v1/chat/completions", a))
        stats = s.stats()
        log = s.log(1 << 30)
    assert hit < 16 and stats["miss_evicted_unwritten"] == 1, (n, hit, stats)  # a role header from memory
    [m] = [m for m in stats["recent_misses"] if m["reason"] == "evicted_unwritten"]
    assert m["stored_tokens"] >= n - 16, m
    assert stats["miss_diverged"] == 0  # the other prompt shares only a role header with it: not a miss
    assert m["served_tokens"] == 0 and m["detail"] == "the write policy (system)", m
    assert any("miss (evicted_unwritten" in line for line in miss_lines(log)), log[-3000:]


def test_reason_cut_refused(tmp_path) -> None:
    """tiny-gemma3's sliding-window layers (a RotatingKVCache of 32 tokens) cannot be cut
    back once they wrapped: a prompt parting from a stored one at token ~400 is a miss
    because of the cut, not the divergence."""
    from tests.support.servers import Server
    from tools.testing.model_builds import model_path

    text = RULES * 2
    a = {"messages": [{"role": "user", "content": text[:700]}], "max_tokens": 2, "temperature": 0}
    b = {"messages": [{"role": "user", "content": text[:400] + " and now something else " + text[500:700]}],
         "max_tokens": 2, "temperature": 0}
    with Server(model_path("tiny-gemma3"), tmp_path / "cache", tmp_path / "server.log") as s:
        s.post("/v1/chat/completions", a)
        s.wait_flushed()
        _, hit = cached(s.post("/v1/chat/completions", b))
        stats = s.stats()
        log = s.log(1 << 30)
    assert stats["miss_cut_refused"] >= 1, {k: v for k, v in stats.items() if "miss" in k}
    [m] = [m for m in stats["recent_misses"] if m["reason"] == "cut_refused"][-1:]
    assert m["served_tokens"] == hit and m["diverged_at"] >= 300
    assert any("miss (cut_refused" in line for line in miss_lines(log)), log[-3000:]


# -- a miss counts the stored entry's own length (issue 52.12) ---------------------------------

LEDGER = " ".join(f"Entry {i}: the ledger of shelf {i * 7 % 13} holds {i + 3} volumes." for i in range(60))


def test_a_disk_miss_counts_the_stored_entry_not_the_request(tmp_path, tiny_llama, caplog) -> None:
    """The next day's request (longer than the stored prompt) parts from it inside a chunk
    others go on from: the log line, the stats and ``kvstore why`` all name the stored
    entry's own length, and count what it held past the divergence (not the request's)."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.adapters.mlx_lm import LRUPromptCache
    from kvstore.serve.prompts import request_tokens
    from tools.testing.model_builds import model_path
    from tools.testing.oracle import prefill

    mdir = model_path("tiny-llama")
    tokenizer = load_tokenizer(mdir)
    stored_text, asked_text = LEDGER[:720], LEDGER[:240] + " Today the archive is closed; " + LEDGER[300:900]
    stored, asked = request_tokens(tokenizer, stored_text), request_tokens(tokenizer, asked_text)
    at, S, n = first_difference(asked, stored), len(stored), len(asked)
    assert 200 < at < S - 300 and n > S + 100 and at % 64, (at, S, n)  # inside a chunk; the request the longer
    cache = tmp_path / "cache"
    first = LRUPromptCache(cache_dir=cache, chunk_tokens=64)
    first.insert_cache(mdir, stored, prefill(tiny_llama[0], stored))
    first.store.close()
    lru = LRUPromptCache(cache_dir=cache, chunk_tokens=64)  # the next day: memory holds nothing
    lru.decode = lambda ids: str(tokenizer.decode(ids))
    caplog.set_level(logging.INFO, logger="kvstore")
    _, rest = lru.fetch_nearest_cache(mdir, asked)
    stats = lru.store.stats()
    lru.store.close()
    assert n - len(rest) == at  # served up to the divergence (the chunk cut there)
    [line] = [r.getMessage() for r in caplog.records if "kvstore: miss (" in r.getMessage()]
    assert line.startswith(f"kvstore: miss (diverged): recomputed {S - at:,} tokens a stored prefix held; served "
                           f"{at:,} of {n:,}, the prompt parts from the stored {S:,}-token prefix (disk) at token {at:,}"), line
    assert f'the store "{visible(tokenizer.decode(stored[at:at + 8]), newlines=False)}"' in line, line
    m = stats["recent_misses"][-1]
    assert (m["stored_tokens"], m["lost_tokens"], m["served_tokens"], m["diverged_at"]) == (S, S - at, at, at), m
    assert stats["miss_lost_tokens"] == S - at and stats["miss_diverged"] == 1
    (tmp_path / "req.txt").write_text(asked_text)
    got = why(tmp_path / "req.txt", {"model": mdir, "dir": cache})
    assert got["reason"] == "diverged" and got["serves"] == at and got["lost_tokens"] == S - at, got
    assert (got["nearest"]["tokens"], got["nearest"]["shared_tokens"]) == (S, at), got["nearest"]


@pytest.mark.parametrize("n_q", [40, 70, 200])
def test_a_miss_names_the_nearest_entry_below_a_chunk(tmp_path, n_q) -> None:
    """Three conversations go on from the chunks the query parts in (two of them, parting
    from each other there too): the miss names the one ``misses.rank`` puts nearest (holding most of the query's length, then the shorter),
    the one ``kvstore why``'s ``_nearest`` picks from the same index."""
    from kvstore import KVStore
    from kvstore.cli.why import _nearest
    from kvstore.index import scan
    from tests.support.caches import ident, synth

    base = [i % 7 + 1 for i in range(300)]
    # the first parts from the others at token 24: two chunks go on from boundary 16, both as near
    entries = [base[:24] + [8] * 26] + [base[:k] for k in (90, 130)]
    query = base[:20] + [9] * (n_q - 20)  # parts from all three at token 20, inside the second 16-token chunk
    who = ident("below")
    s = KVStore(tmp_path / "c", chunk_tokens=16)
    for e in entries:
        s.insert(who, e, synth(e))
    s.close()
    s = KVStore(tmp_path / "c", chunk_tokens=16)
    f = s.fetch(who, query)
    snap = scan(s.disk.index, full=True)
    s.close()
    want = {40: 50, 70: 90, 200: 130}[n_q]  # all hold the query's length: the shorter; else the one holding most
    assert f.n == 20 and f.miss is not None and f.miss.reason == "diverged"
    assert (f.miss.stored, f.miss.at, f.miss.lost) == (want, 20, min(want, n_q) - 20), f.miss
    assert want == max((len(e) for e in entries), key=lambda k: misses.rank(20, k, n_q))
    nearest = next(e for e in entries if len(e) == want)
    assert f.miss.after == tuple(nearest[20:52])  # the entry's own tokens past the divergence, not the chunk's end
    own = [(k, r, snap.tokens[k]) for k, r in snap.entries.items() if r is not None and r.identity == who.digest]
    assert sorted(r.n for _, r, _ in own) == [50, 90, 130]
    near = _nearest(query, own)
    assert near is not None and len(near.tokens) == want and near.common == 20


def test_the_entry_below_a_chunk_is_read_within_a_budget_and_never_trusted_blind(tmp_path) -> None:
    """Hostile cases for naming the entry below a chunk (``disk.plan.entry_below``): a
    subtree too big for its edge budget leaves the chunk's end (a lower bound, never the
    query's length); a token record deleted or planted with other tokens names nothing; the
    store serves the same throughout and keeps serving."""
    from kvstore import KVStore
    from kvstore.disk.plan import entry_below
    from kvstore.index import scan
    from kvstore.keys import encode_tokens
    from kvstore.query import Query
    from tests.support.caches import ident, synth

    base = [i % 7 + 1 for i in range(300)]
    entries = [base[:k] for k in (50, 90, 130)]
    query = base[:20] + [9] * 180
    who = ident("below-hostile")
    s = KVStore(tmp_path / "c", chunk_tokens=16)
    for e in entries:
        s.insert(who, e, synth(e))
    s.close()
    s = KVStore(tmp_path / "c", chunk_tokens=16)
    assert s.disk is not None
    near = misses.Near(len(query))
    q = Query(encode_tokens(query), who.digest, 16, tokens=query, near=near)
    s.disk.lookup(q)
    assert (near.common, near.stored, len(near.below), near.bounded) == (20, 32, 1, True)  # the chunk, 16..32
    assert s.disk.index.view(lambda r: entry_below(r, q, budget=1)) is False
    assert (near.stored, near.bounded) == (32, True)  # out of budget: the chunk's end stays
    assert s.disk.index.view(lambda r: entry_below(r, q)) is True and near.stored == 130
    keys = {r.n: k for k, r in scan(s.disk.index, full=True).entries.items() if r is not None}
    s.disk.index.transact(lambda t: t.delete_raw("tokens", keys[130]))  # deleted
    s.disk.index.transact(lambda t: t.put_raw("tokens", keys[90], encode_tokens([9] * 90)))  # planted: other tokens
    f = s.fetch(who, query)
    assert f.n == 20 and f.miss is not None and (f.miss.stored, f.miss.lost) == (50, 30), f.miss
    assert s.fetch(who, base[:50] + [3]).n == 50  # still serving
    s.close()
