"""The families survey in CI (issue 26): kvstore persists and restores every model family
that needs a special cache identically, or refuses it with a reason, never wrong.

Runs ``tools.harness.families.survey`` (tiny seeded models, entries restored in one new process,
compared with mlx-lm's own save/load and a cold prefill) on ``CI_FAMILIES``: one family
per kind of cache mlx-lm builds (sliding windows, chunked attention, SSM and linear
attention, CacheList hybrids, a class kvstore cannot persist). A new mlx-lm that adds a
family or changes a cache class shows up here as a failing row, not as a wrong restore.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from tools.harness.families import configs, survey

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "tools" / "harness" / "families" / "results" / "results.json"

# one family per cache shape (see tools/harness/families/results/results.md for every family)
CI_FAMILIES = [
    "llama4",            # ChunkedKVCache + KVCache (attention chunks)
    "gemma3_text",       # RotatingKVCache + KVCache (sliding window)
    "gpt_oss",           # RotatingKVCache + KVCache, another layout
    "qwen3_next",        # ArraysCache (gated delta) + KVCache
    "mamba",             # ArraysCache only
    "lfm2",              # ArraysCache (short conv) + KVCache
    "recurrent_gemma",   # ArraysCache + RotatingKVCache
    "baichuan_m1",       # CacheList(ArraysCache, KVCache | RotatingKVCache)
    "deepseek_v32",      # CacheList(KVCache, KVCache)
    "falcon_h1",         # CacheList(ArraysCache, KVCache)
    "rwkv7",             # ArraysCache (RWKV state)
    "deepseek_v41",      # LayerCache: no from_state, memory only (with the reason)
    "llama",             # KVCache + RotatingKVCache (layer_types with sliding layers)
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return {r["family"]: r for r in survey.run(CI_FAMILIES, tmp_path_factory.mktemp("families"))}


@pytest.mark.parametrize("family", CI_FAMILIES)
def test_family_restores_identically_or_is_refused_with_a_reason(rows, family):
    row = rows[family]
    assert row["built"], row.get("why")
    assert row["verdict"] in ("identical", "memory only"), (family, row["verdict"])
    if row["verdict"] == "memory only":
        assert row["memory_only_reason"], row  # said once, with why
        assert row["restore"]["mlx_roundtrip"] != "identical", row  # mlx-lm cannot either
    else:
        assert row["restore"]["kv-prefix"]["n"] == survey.N_PREFIX, row
    cut = row["restore"]["kv-cut"]
    assert cut.get("ok", True) and not cut["corrupt"], row  # a cut is right or a miss, never a drop


def test_survey_results_cover_every_installed_family():
    """The committed survey lists exactly the families of the installed mlx-lm, and none of
    its rows is wrong: a new family (or a removed one) means re-running
    ``python -m tools.harness.families``."""
    got = json.loads(RESULTS.read_text())
    assert sorted(r["family"] for r in got["rows"]) == configs.families()
    assert got["counts"]["wrong"] == 0, [r["verdict"] for r in got["rows"] if r["verdict"].startswith("WRONG")]
