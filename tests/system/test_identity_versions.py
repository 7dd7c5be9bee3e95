"""One model directory, two identities (mlx-lm's model code changed, as between the mlx-lm
0.31 that vllm-mlx pins and the 0.32 of the main install): real stores, the real index.

The newer identity's first store says in the log that the older one holds entries it cannot
use; ``kvstore ls`` says what differs and which one is superseded; ``kvstore gc --max-bytes``
removes the superseded identity's entries before older entries of another model.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import shutil
from typing import Any

import pytest

from kvstore import KVStore, model_identity
from kvstore.identity import Identity
from tools.testing.model_builds import model_path
from tools.testing.oracle import prefill

OLD_MLX_LM = "0.31.3"


def older_code(real: Identity) -> Identity:
    """``real`` as an older mlx-lm computed it: the same files, another model-code digest."""
    comps = {k: v for k, v in real.info["components"].items() if k != "format"}
    comps["code"] = "0" * 32
    info = {k: v for k, v in real.info.items() if k != "components"}
    info["versions"] = dict(info.get("versions") or {}, mlx_lm=OLD_MLX_LM)
    return Identity.from_components(comps, **info)


def cli(*args: str) -> dict[str, Any]:
    from kvstore.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--json"]) == 0, out.getvalue()
    return json.loads(out.getvalue())


@pytest.fixture
def two_identities(tmp_path, tiny_llama, caplog) -> dict[str, Any]:
    """Entries, oldest first: another model's, model A's under the older code, A's under
    the code installed here (its store's log captured)."""
    a, b, cache = tmp_path / "model-a", tmp_path / "model-b", tmp_path / "cache"
    shutil.copytree(model_path("tiny-llama"), a)
    shutil.copytree(model_path("tiny-llama"), b)
    config = json.loads((b / "config.json").read_text())  # another model: the same files would be A's identity
    (b / "config.json").write_text(json.dumps(dict(config, kvstore_test="model b")))
    rng = random.Random(46)
    tokens = [[rng.randrange(1, 250) for _ in range(200)] for _ in range(3)]
    old = older_code(model_identity(a))
    for i, model in enumerate((b, "A under the old mlx-lm", a)):
        store = KVStore(cache, chunk_tokens=64)
        if i == 1:
            store.register(model, old)
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            store.insert(model, tokens[i], prefill(tiny_llama[0], tokens[i]))
        store.close()
    new = model_identity(a)
    assert new.hex != old.hex and new.info["path"] == old.info["path"]
    return {"cache": cache, "old": old, "new": new, "b": model_identity(b), "log": caplog.text}


def test_a_new_identity_says_the_old_one_holds_entries_it_cannot_use(two_identities) -> None:
    t = two_identities
    version = t["new"].info["versions"]["mlx_lm"]
    [line] = [ln for ln in t["log"].splitlines() if "cannot use them" in ln]
    assert "1 entry" in line and t["old"].hex[:12] in line and t["new"].info["path"] in line
    assert f"code (mlx-lm {OLD_MLX_LM} -> {version}) differs" in line
    assert f"kvstore gc --identity {t['old'].hex[:12]}" in line


def test_ls_says_what_differs_and_which_is_superseded(two_identities) -> None:
    t = two_identities
    got = {g["identity"]: g for g in cli("ls", "--cache-dir", str(t["cache"]))["identities"]}
    old, new, b = got[t["old"].hex], got[t["new"].hex], got[t["b"].hex]
    differs = f"code (mlx-lm {OLD_MLX_LM} -> {t['new'].info['versions']['mlx_lm']})"
    assert old["others"] == [{"identity": t["new"].hex, "differs": differs}]
    assert new["others"] == [{"identity": t["old"].hex, "differs": differs}]
    assert old["superseded_by"] == t["new"].hex and new["superseded_by"] is None
    assert b["others"] == [] and b["superseded_by"] is None
    from kvstore.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["ls", "--cache-dir", str(t["cache"])]) == 0
    said = [ln.strip() for ln in out.getvalue().splitlines() if "another identity of this model directory" in ln]
    assert sorted(said) == sorted([f"another identity of this model directory, {t['new'].hex[:12]}: {differs} differs; this one is "
                    "superseded (`kvstore gc` removes it first)",
                    f"another identity of this model directory, {t['old'].hex[:12]}: {differs} differs"]), said


def test_gc_removes_the_superseded_identity_first(two_identities) -> None:
    """One byte over the budget: plain LRU would drop model B's entry (the oldest); the
    superseded identity's goes instead."""
    t = two_identities
    before = cli("ls", "--cache-dir", str(t["cache"]))
    got = cli("gc", "--max-bytes", f"{before['total_bytes'] - 1}B", "--cache-dir", str(t["cache"]))
    assert [(r["identity"], r["reason"]) for r in got["removed"]] == [(t["old"].hex, "superseded")]
    left = {g["identity"] for g in cli("ls", "--cache-dir", str(t["cache"]))["identities"]}
    assert left == {t["new"].hex, t["b"].hex}
