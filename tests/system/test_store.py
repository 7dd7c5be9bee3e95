"""KVStore end to end: restored equals cold, chunking and dedup, corruption, warm start,
write-behind.

Every store here uses ``chunk_tokens=64`` (tests.support.stores.CHUNK), so prompts of 100-300
tokens span several chunks plus a tail and lookups walk real chains.

Synthetic caches (``synth``) hold keys / values that are a pure function of each position's
token id and index, so the exact content a restore must give for any prefix is known
without a model: those tests check bit-exact content, the model tests check behaviour with
the restored-equals-cold oracle (tools.testing.oracle).
"""

from __future__ import annotations

import copy
import pickle
import random
from pathlib import Path

import mlx.core as mx
import pytest
import tests.support.stores as U
from tests.support.caches import assert_synth, ident, rand_tokens, synth, synth_kv_cache
from tests.support.children import run_module
from tests.support.models import TINY_FAMILIES, TRIMMABLE, have_smollm2, requires_smollm2, store_kwargs
from tests.support.prompts import text_prompt
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvstore import KVStore, files, segments
from kvstore.identity import Identity, model_identity
from tools.testing.model_builds import MODELS, model_path
from tools.testing.oracle import cold_run, prefill

C = U.CHUNK


# --------------------------------------------------------------------------- oracle, all families

# L: the query prompt P; Ls: a stored shorter prefix S; div: where a stored longer entry G
# leaves P (G = P[:div] + other tokens); tail2: also store P + more (trim inside a tail).
SHAPES = {
    "tiny": dict(L=200, Ls=150, div=170, g_extra=60, n_gen=16, tail2=True),
    "smollm2": dict(L=110, Ls=100, div=104, g_extra=8, n_gen=4, tail2=False),
}
FAMILIES = TINY_FAMILIES + (["smollm2"] if have_smollm2() else [])
FAMILY_PARAMS = TINY_FAMILIES + [pytest.param("smollm2", marks=requires_smollm2)]


def _shape(family: str) -> dict:
    return SHAPES["smollm2" if family == "smollm2" else "tiny"]


def family_cases(family: str) -> list[dict]:
    """The cases, each a store directory of its own holding ``entries`` and queried with P.

    - exact: P stored, P fetched: n == len(P). Trimmable caches are trimmed by one token
      so the oracle has a token to feed; non-trimmable ones are compared bit for bit with
      the inserted cache (their content is oracle-checked by the other cases, which read
      the same kind of snapshot).
    - shorter: only S = P[:Ls] stored: n == Ls (a shorter prefix).
    - longer: G = P[:div] + other stored (trimmable: trimmed back to div, via a partially
      matching chunk); non-trimmable families also store S and must get S (n == Ls), never
      G trimmed.
    - longer_only (non-trimmable): only G stored: a miss.
    - longer_tail (tiny-llama, -q): P + more stored: n == len(P) - 1 (trim inside a tail).
    """
    sh = _shape(family)
    L, Ls, div = sh["L"], sh["Ls"], sh["div"]
    trim = family in TRIMMABLE
    cases = [
        dict(name="exact", entries=["P"], expect=L, oracle=trim, trim1=trim),
        dict(name="shorter", entries=["S"], expect=Ls, oracle=True, trim1=False),
    ]
    if trim:
        cases.append(dict(name="longer", entries=["G"], expect=div, oracle=True, trim1=False))
        if sh["tail2"]:
            cases.append(dict(name="longer_tail", entries=["G2"], expect=L - 1, oracle=True, trim1=False))
    else:
        cases.append(dict(name="longer", entries=["S", "G"], expect=Ls, oracle=True, trim1=False))
        cases.append(dict(name="longer_only", entries=["G"], expect=0, oracle=False, trim1=False))
    return cases


@pytest.fixture(scope="module")
def prepared(load_named, tmp_path_factory):
    """``prepared(family)``: builds prompts, caches and the cold reference once, writes every
    case's store directory, and checks the memory tier on the way (results kept)."""
    done: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("oracle")

    def prepare(family: str) -> dict:
        if family in done:
            return done[family]
        spec = MODELS[family]
        kv = spec.cache_kwargs
        model, tok = load_named(family)
        path = model_path(family)
        sh = _shape(family)
        L, Ls, div = sh["L"], sh["Ls"], sh["div"]
        seed = sorted(MODELS).index(family)
        P = text_prompt(tok, L, seed=seed)
        Z = text_prompt(tok, sh["g_extra"] + 40, seed=seed + 100)
        while Z[0] == P[div]:
            Z = Z[1:]
        prompts = {"P": P, "S": P[:Ls], "G": P[:div] + Z[: sh["g_extra"]], "G2": P + Z[:30]}
        c_s = prefill(model, prompts["S"], **kv)
        caches = {
            "S": c_s,
            "P": prefill(model, P[Ls:], cache=copy.deepcopy(c_s), **kv),
            "G": prefill(model, prompts["G"][Ls:], cache=copy.deepcopy(c_s), **kv),
        }
        if sh["tail2"]:
            caches["G2"] = prefill(model, Z[:30], cache=copy.deepcopy(caches["P"]), **kv)
        from kvstore import codec

        assert codec.trimmable(caches["P"]) == (family in TRIMMABLE), family
        ref = cold_run(model, P, n_gen=sh["n_gen"], **kv)
        ref_path = root / f"{family}.ref.pkl"
        ref_path.write_bytes(pickle.dumps(ref))
        digests = {k: U.cache_digest(v) for k, v in caches.items()}
        for name, n in (("G", div), ("G2", L - 1)):  # what a longer entry trimmed to n holds
            if name in caches and codec.trimmable(caches[name]):
                cut = copy.deepcopy(caches[name])
                for c in cut:
                    c.trim(len(prompts[name]) - n)
                digests[f"{name}@{n}"] = U.cache_digest(cut)
        memory = {}
        cases = family_cases(family)
        for case in cases:
            case["dir"] = str(root / family / case["name"])
            with KVStore(case["dir"], chunk_tokens=C, **store_kwargs(family)) as s:
                for e in case["entries"]:
                    s.insert(path, prompts[e], caches[e])
                f = s.fetch(path, P)
                res = U.check_fetched(model, f, P, ref, oracle=case["oracle"], trim1=case["trim1"], kv=kv)
                if f.cache is not None:  # the oracle extended the handed-out cache: stored copy intact?
                    again = s.fetch(path, P)
                    res["refetch"] = [again.n, again.source, U.cache_digest(again.cache)]
                memory[case["name"]] = res
        done[family] = dict(family=family, path=str(path), P=P, kv=kv, ref=str(ref_path),
                            cases=cases, memory=memory, digests=digests, L=L, Ls=Ls)
        return done[family]

    return prepare


def _check_case(family: str, prep: dict, case: dict, res: dict, tier: str) -> None:
    where = f"{family}/{case['name']} ({tier})"
    if case["expect"] == 0:
        assert res["n"] == 0 and res["source"] is None, f"{where}: expected a miss, got {res}"
        return
    assert (res["n"], res["source"]) == (case["expect"], tier), f"{where}: {res.get('n')} {res.get('source')}"
    assert res["offsets"] and set(res["offsets"]) == {case["expect"]}, f"{where}: offsets {res['offsets']}"
    if case["name"] == "exact":
        assert res["digest"] == prep["digests"]["P"], f"{where}: restored cache is not bit-identical"
    if case["name"] == "shorter" or (case["name"] == "longer" and family not in TRIMMABLE):
        assert res["digest"] == prep["digests"]["S"], f"{where}: restored cache is not bit-identical"
    if case["name"] in ("longer", "longer_tail") and family in TRIMMABLE:
        stored = "G" if case["name"] == "longer" else "G2"
        assert res["digest"] == prep["digests"][f"{stored}@{case['expect']}"], \
            f"{where}: restored cache is not the stored one trimmed"
    if case["oracle"]:
        assert res["ok"], f"{where}: {res['detail']}"
    assert res["refetch"][:2] == [case["expect"], "memory"], f"{where}: refetch {res['refetch'][:2]}"
    assert res["refetch"][2] == res["digest"], f"{where}: extending a handed-out cache changed the stored one"


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_restore_from_memory_equals_cold(family, prepared):
    """Memory tier, every cache family: exact / shorter / longer-trimmed hits continue
    exactly like a cold prefill; non-trimmable families never reuse a longer entry.

    Exact hits (n == len(P)) leave the oracle nothing to feed: trimmable caches are trimmed
    by one token and checked from len(P) - 1; non-trimmable ones are checked bit for bit
    against the inserted cache, and the "shorter" case (P fetched, a prefix stored: the
    shorter rule returns exactly that stored entry) runs the oracle on the same kind of
    snapshot. See ``family_cases``."""
    prep = prepared(family)
    for case in prep["cases"]:
        _check_case(family, prep, case, prep["memory"][case["name"]], "memory")


def test_restore_from_disk_in_new_process_equals_cold(prepared):
    """Disk tier: a NEW process opens each case's directory with a plain ``KVStore(dir)``,
    fetches P (memory empty: it must come from disk) and runs the oracle; one subprocess
    checks every family and case and reports JSON. Cases and the exact-hit rule as in
    ``test_restore_from_memory_equals_cold``; the cold references are the same (pickled)."""
    preps = [prepared(f) for f in FAMILIES]
    jobs = [dict(family=p["family"], path=p["path"], P=p["P"], kv=p["kv"], ref=p["ref"],
                 store_kw=store_kwargs(p["family"]),
                 cases=[{k: c[k] for k in ("name", "dir", "oracle", "trim1")} for c in p["cases"]])
            for p in preps]
    results = run_module("tests.support.programs.store_disk_fetch", jobs)
    for p in preps:
        for case in p["cases"]:
            res = results[f"{p['family']}/{case['name']}"]
            _check_case(p["family"], p, case, res, "disk")
            if case["expect"]:
                assert res["stats"]["corrupt"] == 0 and res["stats"]["hits_disk"] == 1


# --------------------------------------------------------------------------- lookup rules


def _expected_n(stored: list[list[int]], q: list[int]) -> int:
    """The rule (mlx-lm's, over every stored entry): an entry that is a prefix of q counts
    whole; any other trimmable entry counts its common prefix, leaving one token to feed."""
    best = 0
    for e in stored:
        m = 0
        while m < min(len(e), len(q)) and e[m] == q[m]:
            m += 1
        best = max(best, len(e) if m == len(e) else min(m, len(q) - 1))
    return best


def test_disk_lookup_rules_and_content(tmp_path):
    """Many entries sharing prefixes of various lengths (around chunk boundaries, exact
    multiples of the chunk, inside tails); many queries. The disk tier of a reopened store
    finds the best reusable prefix by the rule and restores exactly its content."""
    r = random.Random(5)
    base = rand_tokens(330, seed=1)
    lengths = [1, 2, 63, 64, 65, 100, 127, 128, 129, 192, 200, 256, 300]
    stored = [base[:n] for n in lengths]
    for _ in range(10):  # branches off the base at random points
        a = r.randrange(1, 300)
        stored.append(base[:a] + rand_tokens(r.randrange(1, 140), seed=r.randrange(10**6)))
    queries = [base[:n] for n in (1, 2, 3, 50, 64, 65, 66, 128, 150, 193, 257, 300, 301, 330)]
    for e in stored[len(lengths):]:
        queries += [e, e[: max(1, len(e) - 5)], e + [7, 7, 7], e[:-1] + [e[-1] + 1]]
    for _ in range(15):
        a = r.randrange(1, 330)
        queries.append(base[:a] + rand_tokens(r.randrange(0, 80), seed=r.randrange(10**6)))
    queries.append(rand_tokens(50, seed=999))  # shares nothing

    who = ident("rules")
    with KVStore(tmp_path, chunk_tokens=C, queue_size=64) as s:
        for e in stored:
            s.insert(who, e, synth(e))
    with KVStore(tmp_path) as s:
        for q in queries:
            want = _expected_n(stored, q)
            plan = s.disk.plan(who, q)
            assert (plan.n if plan else 0) == want, (len(q), want, plan)
            f = s.fetch(who, q)
            assert f.n == want
            if want:
                assert f.source == "disk"
                assert_synth(f.cache, q[:want])
            else:
                assert f.cache is None
            s.memory.clear()
        st = s.stats()
        assert st["corrupt"] == 0 and st["misses"] == sum(_expected_n(stored, q) == 0 for q in queries)


def _expected_snapshot_n(stored: list[list[int]], q: list[int]) -> int:
    """Snapshots (not trimmable) count only when they are a prefix of q."""
    return max([len(e) for e in stored if len(e) <= len(q) and q[: len(e)] == e] or [0])


def test_disk_lookup_among_many_siblings(tmp_path):
    """Hundreds of entries filed under one boundary: some sharing more tokens after it than
    a trie edge spells out (EDGE_TOKENS), some differing in their first token, token ids at
    both ends of the range, snapshots that only count when exact. The seek-based lookup
    finds exactly what the brute-force rule finds."""
    from kvstore.keys import EDGE_TOKENS

    r = random.Random(11)
    C = 256
    head = rand_tokens(EDGE_TOKENS + 12, seed=3)
    stored = [head[: r.randrange(1, len(head))] for _ in range(10)]
    for i in range(150):  # past the spelled-out part; a tiny vocabulary makes long ties
        stored.append(head + rand_tokens(r.randrange(1, 150), seed=100 + i, vocab=3))
    for i in range(100):  # first tokens all over the range, including 0 and 2**32 - 1
        first = r.choice([0, 1, 2**32 - 1, r.randrange(2**32)])
        stored.append([first] + rand_tokens(r.randrange(0, 300), seed=300 + i, vocab=5))
    snaps = [head[:n] for n in (5, 30, EDGE_TOKENS, EDGE_TOKENS + 3)]
    snaps += [head + rand_tokens(r.randrange(1, 40), seed=500 + i, vocab=3) for i in range(30)]
    queries = [head, head[:EDGE_TOKENS], head[:EDGE_TOKENS + 1], [7], [0], [2**32 - 1, 0, 0], []]
    for e in stored + snaps:
        queries += [e, e[:-1], e + [1, 2], e[: max(1, len(e) // 2)] + [4]]
    for i in range(30):
        queries.append(head + rand_tokens(r.randrange(1, 200), seed=700 + i, vocab=3))
    who, who_snap = ident("siblings"), ident("siblings-snapshots")
    with KVStore(tmp_path, chunk_tokens=C, queue_size=512) as s:
        for e in stored:
            s.insert(who, e, synth(e))
        for e in snaps:
            s.insert(who_snap, e, synth(e, snapshot=True))
    with KVStore(tmp_path, chunk_tokens=C) as s:
        for q in queries:
            plan = s.disk.plan(who, q) if q else None
            assert (plan.n if plan else 0) == (_expected_n(stored, q) if q else 0), q
            plan = s.disk.plan(who_snap, q) if q else None
            assert (plan.n if plan else 0) == _expected_snapshot_n(snaps, q), q
        for q in queries[:: len(queries) // 12]:  # and what the plan names restores exactly
            f = s.fetch(who, q)
            assert f.n == (_expected_n(stored, q) if q else 0)
            if f.n:
                assert_synth(f.cache, q[: f.n])
            s.memory.clear()


def test_entry_of_whole_chunks_restores(tmp_path):
    """Regression: a chunked entry whose length is an exact multiple of the chunk has no
    tail blob; fetching it raised TypeError (blob path None) instead of restoring."""
    who = ident("whole")
    toks = rand_tokens(2 * C, seed=3)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, synth(toks))
    with KVStore(tmp_path) as s:
        for q, n in ((toks, 2 * C), (toks + [1, 2], 2 * C), (toks[:100], 99)):
            f = s.fetch(who, q)
            assert (f.n, f.source) == (n, "disk")
            assert_synth(f.cache, q[:n])
            s.memory.clear()


def test_restore_without_shared_memory_is_the_same(tmp_path, monkeypatch):
    """The fallback for an MLX that does not share array memory with numpy (read into
    numpy buffers, one copy into MLX) restores exactly what the direct path does."""
    from kvstore import alloc

    who = ident("fallback")
    toks = rand_tokens(2 * C + 37, seed=8)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, synth(toks))
    monkeypatch.setattr(alloc, "SHARED_MEMORY", False)
    with KVStore(tmp_path) as s:
        for q, n in ((toks, len(toks)), (toks[:100] + [5], 100)):
            f = s.fetch(who, q)
            assert (f.n, f.source) == (n, "disk")
            assert_synth(f.cache, q[:n])
            s.memory.clear()
        assert s.stats()["corrupt"] == 0


@pytest.mark.parametrize("snapshot", [False, True])
def test_restore_allocating_tensor_by_tensor_is_the_same(tmp_path, monkeypatch, snapshot):
    """A restore allocates its arrays in groups and starts reading each group's spans of
    every segment as soon as it exists: with one tensor per group (every segment read
    in many pieces, hashed across groups), chunked and snapshot entries restore exactly,
    and a damaged chunk is still caught, naming that chunk."""
    from kvstore import alloc

    monkeypatch.setattr(alloc, "GROUP", 1)
    monkeypatch.setattr(alloc, "MAX_GROUPS", 1 << 30)
    who = ident("groups")
    toks = rand_tokens(3 * C + 37, seed=9)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, synth(toks, snapshot=snapshot))
        assert s.flush()
        segs = U.entry_segments(s, toks, who)
    with KVStore(tmp_path) as s:
        f = s.fetch(who, toks)
        assert (f.n, f.source) == (len(toks), "disk")
        assert_synth(f.cache, toks, snapshot=snapshot)
    U.damage_segment(segs[1 if not snapshot else 0], "flip")
    with KVStore(tmp_path) as s:
        plan = s.disk.plan(who, toks)
        with pytest.raises(files.BlobError, match="checksum") as e:
            s.disk.restore(plan, who)
        assert e.value.record == (("chunk", plan.chunks[1]) if not snapshot else ("entry", plan.last[1]))


def test_fetch_out_of_file_descriptors_is_a_miss_that_keeps_the_entry(tmp_path):
    """A restore that fails for the process's reasons (EMFILE here) is a miss counted in
    ``io_errors``: the entry is neither dropped nor counted as damage, it is tried once
    (not once per retry), and the next fetch with descriptors to spare restores it."""
    who = ident("emfile")
    toks = rand_tokens(2 * C + 9, seed=12)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, synth(toks))
        s.flush()
        s.memory.clear()
        with U.out_of_descriptors():
            f = s.fetch(who, toks)
        st = s.stats()
        assert (f.n, f.source) == (0, None)
        assert (st["io_errors"], st["corrupt"], st["races"], st["disk_entries"]) == (1, 0, 0, 1), st
        f = s.fetch(who, toks)
        assert (f.n, f.source) == (len(toks), "disk")
        assert_synth(f.cache, toks)


def test_chunk_size_belongs_to_the_directory(tmp_path):
    """Regression: reopening with another (or the default) chunk_tokens silently missed
    every entry, since key boundaries depend on it; the directory now keeps its own."""
    who = ident("chunksize")
    toks = rand_tokens(150, seed=4)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, synth(toks))
    for kw in ({}, {"chunk_tokens": 256}, {"chunk_tokens": 32}):
        with KVStore(tmp_path, **kw) as s:
            assert s.disk.chunk == C
            f = s.fetch(who, toks)
            assert (f.n, f.source) == (150, "disk")


# --------------------------------------------------------------------------- dedup


OVERHEAD = 2048  # generous per-blob header allowance (JSON header + metadata)


def test_shared_prefix_is_stored_once(tmp_path, tiny_llama, make_prompt):
    model, tok = tiny_llama
    base = make_prompt(tok, 250, seed=21)
    other = make_prompt(tok, 80, seed=22)
    a = base
    b = base[:200] + [t for t in other if t != base[200]][:50]
    assert b[200] != a[200] and len(a) == len(b) == 250
    ca = prefill(model, a)
    cb = prefill(model, b[200:], cache=prefill(model, b[:200]))
    bpt = sum(x.nbytes for x in U.layer_arrays(ca).values()) // len(a)  # bytes per token
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(model_path("tiny-llama"), a, ca)
        s.flush()
        bytes_a = U.blob_bytes(tmp_path)
        s.insert(model_path("tiny-llama"), b, cb)
        s.flush()
        grew = U.blob_bytes(tmp_path) - bytes_a
        st = s.stats()
    shared_chunks = 200 // C  # chunks 0-64, 64-128, 128-192 are the same tokens
    assert bytes_a >= len(a) * bpt
    # b only added its own tail (tokens 192..250): the shared 192 tokens were not rewritten
    assert (len(b) - shared_chunks * C) * bpt <= grew <= (len(b) - shared_chunks * C) * bpt + OVERHEAD
    assert st["disk_chunks"] == shared_chunks and st["disk_entries"] == 2
    assert st["disk_bytes"] == U.blob_bytes(tmp_path)
    with KVStore(tmp_path) as s:
        for toks, cache in ((a, ca), (b, cb)):
            f = s.fetch(model_path("tiny-llama"), toks)
            assert (f.n, f.source) == (250, "disk")
            assert U.cache_digest(f.cache) == U.cache_digest(cache)
            s.memory.clear()


def test_conversation_growth_costs_only_new_tokens(tmp_path, tiny_llama):
    """A chat that grows turn by turn, with the SAME live cache extended in place after each
    insert (as a server does): each turn adds bytes for its new tokens (at most one chunk
    plus a tail more), and every stored turn still restores bit-identical afterwards."""
    model, tok = tiny_llama
    path = model_path("tiny-llama")
    msgs = [{"role": "system", "content": "You answer about caches in plain words, briefly."},
            {"role": "user", "content": "What is a prefix cache and why is it useful for chat?"}]
    replies = ["It keeps the keys and values of a prompt so a later prompt skips that prefill.",
               "Yes, when the prefix matches token for token.",
               "Then only the new turn is computed; the stored part is reused as it is."]
    follow = ["Does it work across restarts of the server process?", "And a long system prompt?",
              "Thanks."]
    turns = [tok.apply_chat_template(msgs, tokenize=True)]
    for rep, fol in zip(replies, follow):
        msgs += [{"role": "assistant", "content": rep}, {"role": "user", "content": fol}]
        turns.append(tok.apply_chat_template(msgs, tokenize=True))
    assert all(t2[: len(t1)] == t1 for t1, t2 in zip(turns, turns[1:]))
    assert len(turns[-1]) > 3 * C

    cache = prefill(model, [])
    digests, sizes = [], []
    with KVStore(tmp_path, chunk_tokens=C) as s:
        prev = []
        for t in turns:
            prefill(model, t[len(prev):], cache=cache)  # the live cache, extended in place
            digests.append(U.cache_digest(cache))
            s.insert(path, t, cache)
            s.flush()
            sizes.append(U.blob_bytes(tmp_path))
            prev = t
        bpt = sum(x.nbytes for x in U.layer_arrays(cache).values()) // len(turns[-1])
    for i in range(1, len(turns)):
        new = len(turns[i]) - len(turns[i - 1])
        grew = sizes[i] - sizes[i - 1]
        n_blobs = len(turns[i]) // C - len(turns[i - 1]) // C + 1  # new chunks + a tail
        assert new * bpt <= grew <= (new + C) * bpt + n_blobs * OVERHEAD, (i, new, grew)
    with KVStore(tmp_path) as s:
        for t, d in zip(turns, digests):
            f = s.fetch(path, t)
            assert (f.n, f.source) == (len(t), "disk")
            assert U.cache_digest(f.cache) == d, "a stored turn changed when the live cache grew"
            s.memory.clear()


# --------------------------------------------------------------------------- corruption


def _corruption_store(d: Path) -> dict:
    """A: chunked (150 tokens), A2: shares A's first chunk, B: unrelated, S: a snapshot."""
    A = rand_tokens(150, seed=31)
    A2 = A[:100] + rand_tokens(80, seed=32)
    B = rand_tokens(150, seed=33)
    S = rand_tokens(100, seed=34)
    kv, snap = ident("corrupt-kv"), ident("corrupt-snap")
    with KVStore(d, chunk_tokens=C) as s:
        for t in (A, A2, B):
            s.insert(kv, t, synth(t))
        s.insert(snap, S, synth(S, snapshot=True))
        assert s.flush()
        segs = {"A": U.entry_segments(s, A, kv), "A2": U.entry_segments(s, A2, kv),
                "B": U.entry_segments(s, B, kv), "S": U.entry_segments(s, S, snap)}
    assert len(segs["A"]) == 3 and segs["A"][0] == segs["A2"][0] and len(segs["S"]) == 1
    return dict(A=A, A2=A2, B=B, S=S, kv=kv, snap=snap, segs=segs)


def _fetch_ok_or_shorter(s, who, toks, *, snapshot=False) -> int:
    """Fetch must not raise; a hit must be a valid (bit-exact) prefix."""
    f = s.fetch(who, toks)
    if f.cache is not None:
        assert_synth(f.cache, toks[: f.n], snapshot=snapshot)
    else:
        assert f.n == 0
    s.memory.clear()
    return f.n


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("target", ["A-tail", "A-chunk0", "A-chunk1", "S"])
def test_damaged_blob_is_a_miss_and_the_rest_works(tmp_path, target, how):
    """A damaged blob costs only the entries that need it (a miss or a shorter valid hit),
    is counted in stats()["corrupt"], never raises, and the entries rewritten afterwards
    are stored and restored again."""
    st = _corruption_store(tmp_path)
    name, _, part = target.partition("-")
    idx = {"tail": -1, "chunk0": 0, "chunk1": 1, "": 0}[part]
    bad = st["segs"][name][idx]
    U.damage_segment(bad, how)
    A, A2, B, S, kv, snap = (st[k] for k in ("A", "A2", "B", "S", "kv", "snap"))
    needs_bad = {who: any(U.damaged_by(bad, how, seg) for seg in segs) for who, segs in st["segs"].items()}
    assert needs_bad[name] and not needs_bad["B"]

    with KVStore(tmp_path) as s:
        for _ in range(2):  # and again: the damage was dealt with the first time
            n_a = _fetch_ok_or_shorter(s, kv, A)
            n_s = _fetch_ok_or_shorter(s, snap, S, snapshot=True)
            n_a2 = _fetch_ok_or_shorter(s, kv, A2)
            n_b = _fetch_ok_or_shorter(s, kv, B)
            assert n_b == len(B)
            assert (n_s == len(S)) == (not needs_bad["S"]) and n_s in (0, len(S))
            if needs_bad["A"]:
                assert n_a < len(A)
            else:
                assert n_a == len(A)
            if not needs_bad["A2"]:
                assert n_a2 == len(A2)
        assert s.stats()["corrupt"] >= 1
        # rewriting the damaged entries stores them whole again
        s.insert(kv, A, synth(A))
        s.insert(kv, A2, synth(A2))
        s.insert(snap, S, synth(S, snapshot=True))
    with KVStore(tmp_path) as s:
        for who, t, sn in ((kv, A, False), (kv, A2, False), (kv, B, False), (snap, S, True)):
            f = s.fetch(who, t)
            assert (f.n, f.source) == (len(t), "disk"), (t is A, t is A2, t is B, f.n)
            assert_synth(f.cache, t, snapshot=sn)
            s.memory.clear()
        assert s.stats()["corrupt"] == 0


def test_damaged_middle_chunk_fails_the_whole_restore(tmp_path):
    """A chunked restore reads its blobs on reader threads straight into one set of arrays:
    a damaged chunk in the middle is a BlobError naming that chunk, raised only once every
    reader stopped, with nothing handed out; through the store it is a shorter valid hit
    (the chunks before it) at most."""
    import threading

    who = ident("middle")
    toks = rand_tokens(6 * C + 10, seed=77)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, synth(toks))
        assert s.flush()
        segs = U.entry_segments(s, toks, who)
    assert len(segs) == 7 and len({seg.path for seg in segs}) == 1  # one pack per persist
    U.damage_segment(segs[3], "flip")
    with KVStore(tmp_path) as s:
        plan = s.disk.plan(who, toks)
        assert plan.n == len(toks) and len(plan.chunks) == 6
        with pytest.raises(files.BlobError, match="checksum") as e:
            s.disk.restore(plan, who)
        assert e.value.record == ("chunk", plan.chunks[3])
        assert not [t for t in threading.enumerate() if t.name.startswith("kvstore-restore")]
        n = _fetch_ok_or_shorter(s, who, toks)
        assert n <= 3 * C and s.stats()["corrupt"] == 1


def test_stray_files_are_ignored(tmp_path):
    """Leftovers of a writer that died mid-write (a half-written pack, never indexed) and
    files kvstore did not write: the entry being written is a miss, everything else hits,
    nothing is counted as corrupt, and the entry can be written later."""
    st = _corruption_store(tmp_path)
    A, B, kv = st["A"], st["B"], st["kv"]
    lost = rand_tokens(120, seed=35)
    tail = st["segs"]["A"][-1]
    junk = tail.path.read_bytes()[: tail.offset + tail.length // 2]
    (tail.path.parent / ("ab" * 16 + ".kvpack")).write_bytes(junk)  # a pack no record names
    (tmp_path / "blobs" / "notes.txt").write_bytes(b"not kvstore's")
    with KVStore(tmp_path) as s:
        assert _fetch_ok_or_shorter(s, kv, lost) == 0
        assert _fetch_ok_or_shorter(s, kv, A) == len(A)
        assert _fetch_ok_or_shorter(s, kv, B) == len(B)
        assert s.stats()["corrupt"] == 0
        s.insert(kv, lost, synth(lost))
    with KVStore(tmp_path) as s:
        assert _fetch_ok_or_shorter(s, kv, lost) == len(lost)


@pytest.mark.parametrize("where", ["blob", "index"])
def test_failed_write_leaves_no_entry_and_no_file(tmp_path, monkeypatch, where):
    """A write that fails (the pack's sync, or the index commit: a full disk) costs that
    entry only: counted in write_errors, nothing indexed, no pack file left, no exception
    to the caller. (Regression: an index failure, lmdb.Error, was not counted.)"""
    who = ident("failwrite")
    good, bad = rand_tokens(100, seed=41), rand_tokens(100, seed=42)
    real = segments.PackWriter.seal

    def flaky(*a, **k):
        if flaky.fail:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    flaky.fail = False
    if where == "blob":
        monkeypatch.setattr(segments.PackWriter, "seal", flaky)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        if where == "index":
            _fail_commits(s.disk.index, flaky)
        s.insert(who, good, synth(good))
        s.flush()
        flaky.fail = True
        s.insert(who, bad, synth(bad))
        s.flush()
        flaky.fail = False
        assert s.stats()["write_errors"] == 1
        assert s.fetch(who, bad).source == "memory"
        files = U.blob_files(tmp_path)
    with KVStore(tmp_path) as s:
        assert sorted(files) == sorted({seg.path for seg in U.entry_segments(s, good, who)})  # nothing of `bad`
        assert s.fetch(who, bad).cache is None
        assert s.fetch(who, good).n == len(good)


def _fail_commits(index, armed) -> None:
    """Make the live ``index`` one whose write transactions fail at their commit while
    ``armed.fail`` is set (a subclass in the test, not a hook in kvstore): the
    transaction's writes run, then LMDB's commit error (a full disk's) is raised inside it,
    so LMDB aborts it, as a failed ``mdb_txn_commit`` leaves the index."""
    import lmdb

    class CommitFails(type(index)):
        def transact(self, fn):
            if not armed.fail:
                return super().transact(fn)

            def then_fail(t):
                fn(t)
                raise lmdb.Error("mdb_txn_commit: No space left on device")

            return super().transact(then_fail)

    index.__class__ = CommitFails


# --------------------------------------------------------------------------- warm start


def test_warm_start_reads_no_blob_until_a_restore(tmp_path):
    """A new process finds every entry through the index alone (zero pack files opened);
    the first restore opens exactly that entry's pack file (its chunks and its tail), once."""
    entries = [("warm", rand_tokens(n, seed=50 + n)) for n in (40, 64, 150, 200, 260)]
    entries.append(("warm-snap", rand_tokens(90, seed=60)))
    with KVStore(tmp_path, chunk_tokens=C) as s:
        for name, t in entries:
            s.insert(ident(name), t, synth(t, snapshot=name.endswith("snap")))
        assert s.flush()
        expected = {i: sorted({str(seg.path) for seg in U.entry_segments(s, t, ident(name))})
                    for i, (name, t) in enumerate(entries)}
    which = 3  # the 200-token entry: 3 chunks + a tail
    out = run_module("tests.support.programs.store_warm_start",
                     {"dir": str(tmp_path), "entries": entries, "fetch": which})
    assert out["plans"] == [len(t) for _, t in entries]
    assert out["reads_before"] == 0
    assert out["fetched"] == [200, "disk"]
    assert out["reads_after"] == expected[which] and len(expected[which]) == 1


# --------------------------------------------------------------------------- write-behind


def test_insert_is_write_behind(tmp_path):
    """Inserting a large cache (~168 MB) returns before any of its blobs is written: with
    the writer thread held busy by an earlier job, insert still returns, nothing is on
    disk, and the entry is already served from memory; once the writer runs, flush() puts
    it on disk and a new store finds (and restores) it. (No timing: the writer is held.)"""
    import threading

    who = ident("big")
    n, layers = 2048, 10
    cache = synth_kv_cache(layers, 8, n, 128, shared=True)  # every layer: the same 2 arrays
    nbytes = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert nbytes > 150e6
    toks = rand_tokens(n, seed=70)
    s = KVStore(tmp_path)  # default chunk: 8 chunk blobs of ~21 MB
    gate = threading.Event()
    assert s.writer.submit(lambda: gate.wait(60))  # the writer is busy until the gate opens
    try:
        s.insert(who, toks, cache)
        assert U.blob_files(tmp_path) == [] and s.stats()["writes"] == 0
        assert s.fetch(who, toks).source == "memory"
    finally:
        gate.set()
    assert s.flush()
    on_disk = U.blob_bytes(tmp_path)
    s.close()
    assert nbytes <= on_disk <= nbytes + 9 * OVERHEAD
    with KVStore(tmp_path) as s2:
        f = s2.fetch(who, toks)
        assert (f.n, f.source) == (n, "disk")
        k, v = cache[0].keys, cache[0].values
        for c in (f.cache[0], f.cache[-1]):
            assert mx.array_equal(c.keys, k).item() and mx.array_equal(c.values, v).item()


def test_close_writes_everything_still_in_memory(tmp_path):
    """Entries inserted right before close() are on disk after it (no flush() call), also
    those whose write was dropped because the queue was full (regression: they were lost)."""
    who = ident("close")
    toks = [rand_tokens(100 + i, seed=80 + i) for i in range(12)]
    s = KVStore(tmp_path, chunk_tokens=C, queue_size=2, max_entries=50)
    for t in toks:
        s.insert(who, t, synth(t))
    assert s.stats()["dropped_writes"] > 0
    s.close()
    with KVStore(tmp_path) as s:
        assert s.stats()["disk_entries"] == len(toks)
        for t in toks:
            assert s.fetch(who, t).n == len(t)
            s.memory.clear()


def test_bfloat16_cache_through_the_store(tmp_path):
    who = ident("bf16")
    toks = rand_tokens(150, seed=90)
    cache = synth_kv_cache(2, 2, 150, 32, dtype=mx.bfloat16)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, toks, cache)
    with KVStore(tmp_path) as s:
        f = s.fetch(who, toks)
        assert f.source == "disk" and f.cache[0].keys.dtype == mx.bfloat16
        assert U.cache_digest(f.cache) == U.cache_digest(cache)
        f = s.fetch(who, toks[:100] + [1])
        assert f.n == 100 and U.cache_digest(f.cache) == U.cache_digest(
            [_cut(c, 100) for c in cache])


def _cut(c: KVCache, n: int) -> KVCache:
    out = KVCache()
    out.keys, out.values, out.offset = c.keys[..., :n, :], c.values[..., :n, :], n
    return out


# --------------------------------------------------------------------------- input errors


def test_bad_tokens_raise_and_change_nothing(tmp_path):
    who = ident("bad")
    good = rand_tokens(70, seed=91)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, good, synth(good))
        for bad in ([-2**63 - 1, 2], [1.5], [2**64], [[1, 2]]):
            with pytest.raises(ValueError):
                s.fetch(who, bad)
            with pytest.raises(ValueError):
                s.insert(who, bad, synth([1] * len(bad)) if not isinstance(bad[0], list) else synth([1]))
        with pytest.raises(ValueError):  # a cache holding more positions than tokens
            s.insert(who, good[:10], synth(good))
        s.settle()  # the memory tier has no side effect: pending inserts are filed by settle()
        assert len(s.memory) == 1
    with KVStore(tmp_path) as s:
        assert s.stats()["disk_entries"] == 1


def test_rotating_snapshot_trimmed_only_before_wrap(tmp_path):
    """A RotatingKVCache snapshot still under its window is trimmable (reused for a longer
    stored prompt); once it wrapped it is only reused at exactly its length."""
    who = ident("rot")

    def rot(tokens):
        c = RotatingKVCache(max_size=32)
        base = mx.array(tokens, dtype=mx.float32)[None, None, :, None] * mx.ones((1, 1, 1, 4))
        c.update_and_fetch(base, base + 1)
        mx.eval(c.keys, c.values)
        return [c]

    short, long_ = rand_tokens(20, seed=92), rand_tokens(60, seed=93)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, short, rot(short))
        s.insert(who, long_, rot(long_))
    with KVStore(tmp_path) as s:
        f = s.fetch(who, short[:15] + [1, 2])
        assert (f.n, f.source) == (15, "disk") and f.cache[0].offset == 15
        s.memory.clear()
        assert s.fetch(who, long_[:50] + [1, 2]).cache is None  # wrapped: no trim
        f = s.fetch(who, long_ + [1, 2])
        assert f.n == 60 and U.cache_digest(f.cache) == U.cache_digest(rot(long_))


def test_disk_hit_keeps_its_cache_type(tmp_path):
    """Regression: a disk hit was promoted into memory as 'assistant' whatever type it was
    stored with, so eviction order after a restart differed from before."""
    who = ident("ctype")
    sys_t, user_t = rand_tokens(80, seed=95), rand_tokens(90, seed=96)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(who, sys_t, synth(sys_t), cache_type="system")
        s.insert(who, user_t, synth(user_t), cache_type="user")
    with KVStore(tmp_path) as s:
        assert s.fetch(who, sys_t).source == "disk" and s.fetch(who, user_t).source == "disk"
        by_type = s.memory.stats_by_type()
        assert [by_type[k]["n_sequences"] for k in ("assistant", "user", "system")] == [0, 1, 1]


# --------------------------------------------------------------------------- caches of another model


def _llama_variant(**changes: int) -> object:
    """tiny-llama's architecture with ``changes`` to its config: another model with the
    same layer count and cache classes, other KV shapes (weights lazily initialised)."""
    import json

    from mlx_lm.models import llama

    cfg = json.loads((model_path("tiny-llama") / "config.json").read_text())
    return llama.Model(llama.ModelArgs.from_dict({**cfg, **changes}))


def _as_dtype(cache: list, dtype: mx.Dtype) -> list:
    out = []
    for c in cache:
        k = KVCache()
        k.update_and_fetch(c.keys[..., : c.offset, :].astype(dtype), c.values[..., : c.offset, :].astype(dtype))
        out.append(k)
    mx.eval([a for c in out for a in (c.keys, c.values)])
    return out


@pytest.mark.parametrize("other, says", [
    ({"num_key_value_heads": 4}, "cache layer 0 has 4 KV heads x head_dim 32, tiny-llama-v1 makes 2 x 32"),
    ({"head_dim": 16}, "cache layer 0 has 2 KV heads x head_dim 16, tiny-llama-v1 makes 2 x 32"),
    ("bfloat16", "cache layer 0 holds bfloat16 KV, tiny-llama-v1 makes float32"),
])
def test_cache_of_another_model_with_the_same_classes_stays_in_memory(tmp_path, tiny_llama, caplog, other, says):
    """Regression (fault harness, bad input): a cache with tiny-llama's layer count and
    classes but other KV heads, head_dim or dtype was persisted under tiny-llama. It is
    refused like any layout mismatch: counted unpersistable, warned once, kept in memory
    only, and nothing reaches the disk; the model's own cache still does."""
    path = model_path("tiny-llama")
    toks = rand_tokens(100, seed=97, vocab=256)
    good = prefill(tiny_llama[0], toks)
    bad = _as_dtype(good, mx.bfloat16) if other == "bfloat16" else prefill(_llama_variant(**other), toks)
    assert [type(c).__name__ for c in bad] == [type(c).__name__ for c in good]
    with KVStore(tmp_path, chunk_tokens=C) as s:
        with caplog.at_level("WARNING", logger="kvstore"):
            s.insert(path, toks, bad)
            s.insert(path, toks + [7], bad)  # a cache may cover fewer tokens than given
        assert s.flush(60)
        assert s.stats()["unpersistable"] == 2
        assert [r.getMessage() for r in caplog.records] == [f"kvstore: {says} (a cache from another model?); "
                                                            "kept in memory only"]
        assert s.fetch(path, toks).source == "memory"  # the caller's own, as other layout mismatches
        assert s.stats()["disk_entries"] == 0 and U.blob_files(tmp_path) == []
        s.insert(path, toks, good)
    with KVStore(tmp_path) as s:
        f = s.fetch(path, toks)
        assert f.source == "disk" and U.cache_digest(f.cache) == U.cache_digest(good)
        assert s.stats()["disk_entries"] == 1


def test_disk_entry_of_another_model_is_never_returned(tmp_path, tiny_llama):
    """An entry under tiny-llama's digest whose KV shapes are another model's (written by a
    writer that did not check) is dropped at restore: a miss, counted as corrupt."""
    path = model_path("tiny-llama")
    real = model_identity(path)
    unchecked = Identity(real.digest, {"name": "unchecked"})  # same digest, no layout to check against
    toks = rand_tokens(100, seed=98, vocab=256)
    with KVStore(tmp_path, chunk_tokens=C) as s:
        s.insert(unchecked, toks, prefill(_llama_variant(num_key_value_heads=4), toks))
    with KVStore(tmp_path) as s:
        assert s.stats()["disk_entries"] == 1
        f = s.fetch(path, toks)
        assert f.cache is None and f.n == 0
        assert s.stats()["corrupt"] >= 1 and s.stats()["hits_disk"] == 0
        assert s.fetch(real, toks).cache is None


def test_restores_beside_mlx_lm_prefill_never_deadlock(tmp_path):
    """Regression: a restore on one thread (``--preload-background``) and mlx-lm's prefill
    loop on another, which calls ``mx.clear_cache()`` (it waits for every CPU stream while
    holding the GIL), deadlocked within seconds when restores had MLX read through a
    Python file object (its reads need the GIL). Both threads must run to the end."""
    got = run_module("tests.support.programs.store_restore_beside_prefill",
                     {"dir": str(tmp_path), "restores": 300, "timeout": 90}, timeout=180)
    assert got["restores"] == 300 and got["prefill_steps"] > 0 and got["corrupt"] == 0, got
