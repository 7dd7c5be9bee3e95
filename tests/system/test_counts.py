"""Every hit and miss counted as it happened (issue 45), against real ``kvstore serve``
processes: a prompt sharing only a template header is a miss in every tier, a miss costs
what the best stored prefix held past the divergence, a tenant's lookups never move the
counters another caller reads, ``--min-disk-hit``'s "or the whole prompt" holds inside a
longer entry, and each miss is named in the request's own terms (``kvstore.parts``).

Real components throughout: the tiny-llama model and its tokenizer, the tool-rendering
chat template (benchmarks.agent_session), real servers and HTTP clients.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.system.test_misses import (AS_SENT, RULES, UUID2, anthropic_body, cached, first_difference, miss_lines, openai_body,
                               system, tool_model)  # noqa: F401 (tool_model: a fixture)

__all__ = ["tool_model"]

TWENTY = tuple(f"Tool{i:02d}" for i in range(20))


def tools(names: tuple[str, ...] = TWENTY) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n,
                                              "parameters": {}}} for n in names]


def lookups(stats: dict[str, Any]) -> tuple[int, int]:
    """(hits in every tier, misses)."""
    return sum(stats[f"hits_{t}"] for t in ("memory", "disk", "shared")), stats["misses"]


def test_header_only_prompt_is_a_miss_in_memory_as_on_disk(tmp_path) -> None:
    """Two never-seen prompts that share only the chat template's header with what memory
    holds: ``cached_tokens: 0`` on both APIs and counted as misses (before: 5-6 tokens
    "cached" and a memory hit), as after a restart."""
    from tests.support.servers import Server
    from tools.testing.model_builds import model_path

    a = openai_body(system())
    b = {"messages": [{"role": "system", "content": "Quite another assistant. " + RULES[::-1]},
                      {"role": "user", "content": "Anything?"}], "max_tokens": 4, "temperature": 0}
    c = dict(anthropic_body("Yet another assistant entirely. " + RULES[100:]), tools=[])
    with Server(model_path("tiny-llama"), tmp_path / "cache", tmp_path / "server.log") as s:
        s.post("/v1/chat/completions", a)
        before = s.stats()
        _, hit_b = cached(s.post("/v1/chat/completions", b))
        _, hit_c = cached(s.post("/v1/messages", c))
        after = s.stats()
    assert (hit_b, hit_c) == (0, 0)
    assert lookups(after)[0] == lookups(before)[0], {k: after[k] - before[k] for k in ("hits_memory", "misses")}
    assert lookups(after)[1] == lookups(before)[1] + 2
    assert after["tokens_memory"] == before["tokens_memory"]


def test_whole_prompt_inside_a_longer_entry_beats_min_disk_hit(tmp_path) -> None:
    """A short request repeated after a restart sits inside its own longer entry (prompt and
    reply): "or the whole prompt" applies, so all but the one token kept are restored
    (before: 0 under the default --min-disk-hit)."""
    from tests.support.servers import Server
    from tools.testing.model_builds import model_path

    body = {"messages": [{"role": "user", "content": "Name three colours of the rainbow, please."}],
            "max_tokens": 8, "temperature": 0}
    cache = tmp_path / "cache"
    with Server(model_path("tiny-llama"), cache, tmp_path / "server1.log") as s:
        n, _ = cached(s.post("/v1/chat/completions", body))
        s.wait_flushed()
    assert n < 64  # under the default --min-disk-hit
    with Server(model_path("tiny-llama"), cache, tmp_path / "server2.log") as s:
        n2, hit = cached(s.post("/v1/chat/completions", body))
        stats = s.stats()
    assert n2 == n and hit == n - 1 and stats["hits_disk"] == 1, (n, hit, stats["hits_disk"])


def repro_bodies() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The issue's case: system S alone (an agent's quota probe), then S and 20 tools, then S
    changed at its end with the same tools. Both stored prompts part from the last at the
    same token; the first ends a few tokens past it, the second holds the tools."""
    probe = openai_body(system())
    return probe, openai_body(system(), tools()), openai_body(system() + " Be brief.", tools())


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_big_miss_is_counted_at_its_cost(tmp_path, tool_model, tier) -> None:
    """The issue's reproduction on a fresh server (``repro_bodies``). The miss costs what the
    stored conversation with the tools held past the change (thousands of tokens), not the
    few tokens the probe's entry reaches past it; it is logged and listed. ``disk``: the
    same after a restart, from the disk tier's candidates."""
    from mlx_lm.utils import load_tokenizer

    from kvstore.serve.prompts import request_tokens
    from tests.support.servers import Server

    tokenizer = load_tokenizer(tool_model)
    probe, a, b = repro_bodies()
    ta, tb = request_tokens(tokenizer, a), request_tokens(tokenizer, b)
    at = first_difference(ta, tb)
    assert first_difference(request_tokens(tokenizer, probe), tb) == at
    recomputed = len(tb) - at
    assert recomputed > 1000, (len(tb), at)
    cache = tmp_path / "cache"
    with Server(tool_model, cache, tmp_path / "server1.log", AS_SENT) as s:  # a date that diverges, as sent
        s.post("/v1/chat/completions", probe)
        s.post("/v1/chat/completions", a)
        s.wait_flushed()
    with Server(tool_model, cache, tmp_path / "server2.log", AS_SENT) as s:
        if tier == "memory":
            s.post("/v1/chat/completions", probe)
            s.post("/v1/chat/completions", a)
        before = s.stats()
        n, hit = cached(s.post("/v1/chat/completions", b))
        after = s.stats()
        log = s.log(1 << 30)
    assert n == len(tb) and hit <= at
    lost = after["miss_lost_tokens"] - before["miss_lost_tokens"]
    print(f"{tier}: recomputed {len(tb) - hit:,} tokens, counted {lost:,}")
    assert lost >= len(ta) - at, (lost, recomputed, hit, at)  # all the stored prompt held past the change
    [m] = after["recent_misses"][len(before["recent_misses"]):]
    assert m["reason"] == "diverged" and m["diverged_at"] == at and m["lost_tokens"] == lost, m
    assert any(f"at token {at:,}" in line for line in miss_lines(log)), log[-3000:]


# -- a tenant's lookups never move what another caller reads ---------------------------------

LOOKUP = ("hits_memory", "hits_disk", "misses", "tokens_memory", "tokens_saved", "miss_diverged", "miss_lost_tokens")
FAMILIES = ("kvstore_hits_total", "kvstore_misses_total", "kvstore_miss_reasons_total", "kvstore_restored_tokens_total",
            "kvstore_miss_lost_tokens_", "kvstore_miss_parts_total")


def lookup_metrics(text: str) -> list[str]:
    """The lines of a /metrics scrape that count lookups (the gauges are the server's)."""
    return [line for line in text.splitlines() if line.startswith(FAMILIES)]


def test_a_tenants_lookups_cannot_be_differenced_out_of_shared_counts(tmp_path) -> None:
    """Two key holders under --isolate-keys, and a caller without a salt: B and the
    unsalted reader read /v1/cache/stats and /metrics around each of A's requests (a hit,
    then a diverged miss) and see nothing move; A reads its own counts (before: A's hit
    length, divergence and lost tokens were the shared counters' difference)."""
    from tests.support.servers import Server
    from tests.system.test_tenants_server import call
    from tools.testing.model_builds import model_path

    key_a, key_b = "key-tenant-a-0001", "key-tenant-b-0002"
    base = openai_body(system())
    changed = openai_body(system(date="2026-12-01"))
    extra = ["--api-key", key_a, "--api-key", key_b, "--isolate-keys"]

    def read(s: Server, key: str, salt: str | None = None) -> tuple[dict[str, Any], str]:
        status, got = call(s, "GET", "/v1/cache/stats" + (f"?cache_salt={salt}" if salt else ""), key=key)
        assert status == 200, got
        return ({k: got[k] for k in LOOKUP} | {"recent": len(got["recent_misses"])},
                lookup_metrics(call(s, "GET", "/metrics", key=key)[1]))

    with Server(model_path("tiny-llama"), tmp_path / "cache", tmp_path / "server.log", extra) as s:
        seen = [read(s, key_b)]
        own = [read(s, key_a)[0]]
        for body in (base, base, changed):
            status, got = call(s, "POST", "/v1/chat/completions", body, key=key_a)
            assert status == 200, got
            seen.append(read(s, key_b))
            own.append(read(s, key_a)[0])
        status, got = call(s, "POST", "/v1/chat/completions", dict(changed, cache_salt="conversation-7"), key=key_a)
        assert status == 200, got
        seen.append(read(s, key_b))
        salted_own = read(s, key_a, "conversation-7")[0]
    assert all(v == seen[0] for v in seen), seen  # B sees nothing of A: counts nor metrics
    assert own[0]["misses"] == 0 and own[-1]["hits_memory"] == 2 and own[-1]["misses"] == 1, own
    assert own[-1]["miss_diverged"] == 1 and own[-1]["miss_lost_tokens"] > 100 and own[-1]["recent"] == 1, own
    assert salted_own["misses"] == 1 and salted_own["hits_memory"] == 0, salted_own  # key and body salt: its own


def test_an_unsalted_reader_cannot_difference_a_salted_request(tmp_path) -> None:
    """No keys: a request's cache_salt keeps its lookups out of the counts everyone reads;
    ``?cache_salt=`` reads them."""
    from tests.support.servers import Server
    from tests.system.test_misses import urlread
    from tools.testing.model_builds import model_path

    with Server(model_path("tiny-llama"), tmp_path / "cache", tmp_path / "server.log") as s:
        before, metrics_before = s.stats(), lookup_metrics(urlread(s.url + "/metrics"))
        for body in (openai_body(system()), openai_body(system()), openai_body(system(date="2026-12-01"))):
            s.post("/v1/chat/completions", dict(body, cache_salt="alice"))
        after, metrics_after = s.stats(), lookup_metrics(urlread(s.url + "/metrics"))
        alice = s.get("/v1/cache/stats?cache_salt=alice")
    assert {k: after[k] for k in LOOKUP} == {k: before[k] for k in LOOKUP}, after
    assert metrics_after == metrics_before
    assert alice["hits_memory"] == 2 and alice["misses"] == 1 and alice["miss_diverged"] == 1, alice


# -- kvstore why: the body's cache_salt, unreadable files -------------------------------------


def test_why_salts_the_identity_from_the_body(tmp_path) -> None:
    """A server stores one request under cache_salt "bob": ``kvstore why`` on the same body
    serves what the server would (bob: all of it; alice: nothing, the entries are another
    identity's, ``salted`` naming the difference)."""
    import json as json_mod

    from tests.support.servers import Server
    from tests.system.test_misses import why
    from tools.testing.model_builds import model_path

    model = model_path("tiny-llama")
    cache = tmp_path / "cache"
    body = dict(openai_body(system()), cache_salt="bob")
    store = {"model": model, "dir": cache}
    answers = {}
    with Server(model, cache, tmp_path / "server.log", AS_SENT) as s:  # as test_misses.why renders
        n, _ = cached(s.post("/v1/chat/completions", body))
        s.wait_flushed()
        for salt in ("bob", "alice"):  # kvstore why first, on the directory the server uses
            (tmp_path / f"{salt}.json").write_text(json_mod.dumps(dict(body, cache_salt=salt)))
            answers[salt] = why(tmp_path / f"{salt}.json", store)
        _, hit_bob = cached(s.post("/v1/chat/completions", body))
        _, hit_alice = cached(s.post("/v1/chat/completions", dict(body, cache_salt="alice")))
    bob, alice = answers["bob"], answers["alice"]
    assert hit_bob > 0 and bob["serves"] >= hit_bob and bob["reason"] is None and bob["entries"] >= 1, bob
    assert hit_alice == 0 and alice["serves"] == 0 and alice["entries"] == 0, alice
    assert alice["reason"] == "other_identity" and alice["detail"] == "salted", alice
    assert alice["other_identities"][0]["differs"] == ["salted"]


@pytest.mark.parametrize("content", ["deep", "latin1"])
def test_why_says_an_unreadable_request_in_one_line(tmp_path, content) -> None:
    import subprocess
    import sys

    from tests.support import ROOT
    from tests.support.children import child_env
    from tools.testing.model_builds import model_path

    req = tmp_path / "req.json"
    if content == "deep":
        req.write_text("[" * 5000 + "]" * 5000)
    else:
        req.write_bytes('{"messages": [{"role": "user", "content": "caf\u00e9 cr\u00e8me"}]}'.encode("latin-1"))
    (tmp_path / "cache").mkdir()
    p = subprocess.run([sys.executable, "-m", "kvstore.cli", "why", str(req), "--model", str(model_path("tiny-llama")),
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=120,
                       env=child_env(), cwd=str(ROOT))
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("kvstore: error: "), p.stderr
    assert "Traceback" not in p.stderr


# -- the divergence named in the request's own terms -------------------------------------------


def test_misses_are_named_in_the_requests_terms(tmp_path, tool_model) -> None:
    """One server, a base request and one change each: the system text, the tools' order,
    the user's message (OpenAI), the system text (Anthropic), then the chat template file
    (the model's identity). Each miss names the part of the request it starts in, in the
    log line, ``recent_misses`` (no tool names: prompt text), the Prometheus ``part`` label
    and ``kvstore why``."""
    import json as json_mod

    from tests.support.servers import Server
    from tests.system.test_misses import DATE, served_request, urlread, why

    names = TWENTY[:6]
    question = "Which shelf keeps ledgers for 5 years? " + RULES[:400]  # a change early in it costs 400 tokens

    def asked(q: str, sys_text: str = system(), listed: tuple[str, ...] = names) -> dict[str, Any]:
        body = openai_body(sys_text, tools(listed))
        body["messages"][1]["content"] = q
        return body

    base = asked(question)
    changed_user = asked(question.replace("5 years", "9 years"))
    sys_char = system().index(DATE) + len(DATE) - 1  # 2026-11-25 -> 2026-11-26: the last digit
    cases = [  # (path, body, part, where)
        ("/v1/chat/completions", asked(question, system(date="2026-11-26")), "system", f"system, char {sys_char}"),
        ("/v1/chat/completions", asked(question, listed=names[:2] + (names[3], names[2]) + names[4:]), "tools",
         'tools[2] "Tool03" (order changed)'),
        ("/v1/chat/completions", changed_user, "messages", "messages[1] (user), char 30"),
    ]
    anthropic_base = anthropic_body(system(uuid=UUID2))
    cases.append(("/v1/messages", anthropic_body(system(uuid=UUID2, date="2026-11-26")), "system",
                  f"system, char {sys_char}"))
    cache = tmp_path / "cache"
    with Server(tool_model, cache, tmp_path / "server.log", AS_SENT) as s:
        s.post("/v1/chat/completions", base)
        s.post("/v1/messages", anthropic_base)
        s.wait_flushed()
        first = s.stats()
        answers = []
        for i, (path, body, _, _) in enumerate(cases):
            (tmp_path / f"{i}.json").write_text(json_mod.dumps(served_request(path, body)))
            answers.append(why(tmp_path / f"{i}.json", {"model": tool_model, "dir": cache}))
            s.post(path, body)
        stats = s.stats()
        metrics_text = urlread(s.url + "/metrics")
        log = s.log(1 << 30)
        template = json_mod.loads((tool_model / "tokenizer_config.json").read_text())["chat_template"]
        (tool_model / "chat_template.jinja").write_text("{# v2 #}" + template)
        (tmp_path / "base.json").write_text(json_mod.dumps(served_request("/v1/chat/completions", base)))
        model_answer = why(tmp_path / "base.json", {"model": tool_model, "dir": cache})
        s.post("/v1/chat/completions", base)
        changed = s.stats()
        later = miss_lines(s.log(1 << 30))[len(miss_lines(log)):]
    listed = stats["recent_misses"][len(first["recent_misses"]):]
    assert [(m["part"], m["where"]) for m in listed] == [(p, w.replace(' "Tool03"', "")) for _, _, p, w in cases], listed
    lines = miss_lines(log)[-len(cases):]
    for line, (_, _, _, where) in zip(lines, cases):
        assert f"miss (diverged) in {where}: " in line, (line, where)
    for got, (_, _, part, where) in zip(answers, cases):
        assert got["part"] == {"part": part, "where": where}, got
    for part in ("system", "tools", "messages"):
        n = stats[f"miss_part_{part}"] - first[f"miss_part_{part}"]
        assert n == sum(1 for c in cases if c[2] == part), (part, n)
        assert f'kvstore_miss_parts_total{{part="{part}"}} {stats[f"miss_part_{part}"]:.1f}' in metrics_text
    m = changed["recent_misses"][-1]
    assert (m["reason"], m["part"], m["where"]) == ("other_identity", "model", "model identity (chat_template)"), m
    assert "miss (other_identity: chat_template) in model identity (chat_template): " in later[-1], later
    assert model_answer["part"] == {"part": "model", "where": "model identity (chat_template)"}, model_answer


def test_a_lost_prefix_is_named_the_previous_turn_not_in_the_store(tmp_path) -> None:
    """--persist system keeps a conversation without a system prompt off the disk and a
    one-entry memory tier drops it: asked again, the miss names the previous turn as not in
    the store (``recent_misses``, the log line, the ``part`` metric)."""
    from tests.support.servers import Server
    from tests.system.test_misses import urlread
    from tools.testing.model_builds import model_path

    a = {"messages": [{"role": "user", "content": system() + " " + "Which shelf keeps ledgers for 5 years?"}],
         "max_tokens": 4, "temperature": 0}
    b = {"messages": [{"role": "user", "content": "Something else entirely. " + RULES}], "max_tokens": 4,
         "temperature": 0}
    extra = ["--persist", "system", "--prompt-cache-size", "1"]
    with Server(model_path("tiny-llama"), tmp_path / "cache", tmp_path / "server.log", extra) as s:
        for body in (a, b, a):
            s.post("/v1/chat/completions", body)
        stats = s.stats()
        metrics_text = urlread(s.url + "/metrics")
        log = s.log(1 << 30)
    [m] = [m for m in stats["recent_misses"] if m["reason"] == "evicted_unwritten"]
    assert (m["part"], m["where"]) == ("previous_turn", "previous turn not in the store (evicted_unwritten)"), m
    assert stats["miss_part_previous_turn"] == 1
    assert 'kvstore_miss_parts_total{part="previous_turn"} 1.0' in metrics_text
    assert any("miss (evicted_unwritten: " in line and ") in previous turn not in the store" in line
               for line in miss_lines(log)), log[-3000:]


def test_parts_located_from_the_rendered_request(tool_model) -> None:
    """``parts.locate`` with the model's real tokenizer and tool template, for a change in
    each part: the system text, the tools' order (and a renamed tool: not an order change),
    a user message, an assistant turn, a content block."""
    import copy

    from mlx_lm.utils import load_tokenizer

    from kvstore.serve.prompts import request_tokens
    from kvstore.serve.rendered import Rendered, block_lengths
    from kvstore.misses import Miss

    tok = load_tokenizer(tool_model)
    names = TWENTY[:6]
    base = openai_body(system(), tools(names))

    def said(body: dict[str, Any], ref: dict[str, Any]) -> str:
        ta, tb = request_tokens(tok, ref), request_tokens(tok, body)
        at = first_difference(ta, tb)
        msgs = copy.deepcopy(body["messages"])
        blocks = block_lengths(msgs)
        for m in msgs:  # as mlx_lm.server's _tokenize leaves them: text blocks joined
            if isinstance(m["content"], list):
                m["content"] = "".join(b["text"] for b in m["content"])
        chat = Rendered(msgs, body.get("tools"), tok, {}, len(tb), tuple(tb[-4:]), blocks)
        return chat.name(tb)(Miss("diverged", len(tb), at, at, len(ta), after=tuple(ta[at:at + 32]))).said()

    def turn(*contents: Any) -> dict[str, Any]:
        return dict(base, messages=[base["messages"][0], *({"role": r, "content": c} for r, c in contents)])

    blocks = [{"type": "text", "text": "Which shelf keeps ledgers for 5 years?"}, {"type": "text", "text": "Block here."}]
    blocks2 = [blocks[0], {"type": "text", "text": "Block there."}]
    assert said(openai_body(system(date="2026-11-26"), tools(names)), base) == \
        f"system, char {system().index('2026-11-25') + 9}"
    assert said(openai_body(system(), tools(names[:2] + (names[3], names[2]) + names[4:])), base) == \
        'tools[2] "Tool03" (order changed)'
    assert said(openai_body(system(), tools(names[:2] + ("Zed",) + names[3:])), base) == 'tools[2] "Zed"'
    asked = turn(("user", "Which shelf keeps ledgers for 9 years?"))
    assert said(asked, base) == "messages[1] (user), char 30"
    q, q2 = ("user", "Q?"), ("user", "And for 7 years?")
    assert said(turn(q, ("assistant", "Shelf 2."), q2), turn(q, ("assistant", "Shelf 1."), q2)) == \
        "messages[2] (assistant), char 6"
    assert said(turn(("user", blocks2)), turn(("user", blocks))) == "messages[1] (user), block 1, char 6"
