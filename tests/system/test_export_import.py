"""``kvstore export`` / ``kvstore import``: mlx-lm prompt-cache files in and out.

Both directions run mlx-lm's own commands as subprocesses on tiny-llama: a file made by
``mlx_lm.cache_prompt`` is imported, a stored entry is exported and used by
``mlx_lm.generate --prompt-cache-file``. Greedy generations are compared: from the
imported entry restored by kvstore against a cold prefill (token ids, in this process),
and mlx_lm.generate with the exported file against the same command with mlx-lm's own
file (its printed text).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.support import ROOT
from tests.support.children import child_env
from tests.system.test_cli import cli

PROMPT = ("You are a careful assistant. Answer in one short sentence and name your sources. "
          "The question is about the history of the city of Lyon and its silk weavers.")
QUERY = "What did they build?"


def mlx_lm(*args: object) -> str:
    """Run an mlx-lm command (``python -m mlx_lm NAME ...``); its stdout."""
    p = subprocess.run([sys.executable, "-m", "mlx_lm", *map(str, args)], capture_output=True, text=True,
                       timeout=600, env=child_env(), cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def generated(cache_file: Path) -> str:
    """The text ``mlx_lm.generate --prompt-cache-file`` writes for QUERY, greedy."""
    out = mlx_lm("generate", "--prompt-cache-file", cache_file, "--prompt", QUERY, "--max-tokens", 12,
                 "--temp", 0, "--verbose", "True")
    return out.split("==========")[1]


def greedy(model, cache: list, tokens: list[int], n: int = 12) -> list[int]:
    out, x = [], tokens
    for _ in range(n):
        logits = model(mx.array([x]), cache=cache)
        out.append(int(mx.argmax(logits[0, -1]).item()))
        x = out[-1:]
    return out


def entries(cache_dir: Path) -> list[dict]:
    if not (cache_dir / "index" / "data.mdb").exists():
        return []
    p = cli("ls", "--json", cache_dir=cache_dir)
    assert p.returncode == 0, p.stderr
    return [e for i in json.loads(p.stdout)["identities"] for e in i["entries"]]


def imported(made, cache_dir: Path) -> dict:
    """Import mlx_lm.cache_prompt's file into ``cache_dir``; the one entry it makes."""
    d, model_dir = made
    p = cli("import", d / "mlx.safetensors", "--model", model_dir, "--prompt-file", d / "prompt.txt",
            cache_dir=cache_dir)
    assert p.returncode == 0, p.stderr
    [entry] = entries(cache_dir)
    return entry


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama):
    """mlx_lm.cache_prompt's file for PROMPT, the prompt file, and the model directory."""
    from tools.testing.model_builds import model_path

    d = tmp_path_factory.mktemp("mlxfiles")
    (d / "prompt.txt").write_text(PROMPT)
    model = model_path("tiny-llama")
    mlx_lm("cache_prompt", "--model", model, "--prompt", PROMPT, "--prompt-cache-file", d / "mlx.safetensors")
    return d, model


def test_import_cache_prompt_file_restores_like_a_cold_prefill(made, tiny_llama, tmp_path):
    from kvstore import KVStore
    from kvstore.cli.transfer import cache_prompt_tokens

    d, model_dir = made
    p = cli("import", d / "mlx.safetensors", "--model", model_dir, "--prompt-file", d / "prompt.txt",
            cache_dir=tmp_path / "c")
    assert p.returncode == 0, p.stderr
    model, tokenizer = tiny_llama
    prompt = cache_prompt_tokens(tokenizer, PROMPT)
    query = tokenizer.encode(QUERY, add_special_tokens=False)
    with KVStore(tmp_path / "c") as store:
        got = store.fetch(model_dir, prompt + query)
    assert (got.source, got.n) == ("disk", len(prompt))
    from mlx_lm.models.cache import make_prompt_cache

    assert greedy(model, got.cache, query) == greedy(model, make_prompt_cache(model), prompt + query)


def test_export_is_used_by_mlx_lm_generate_as_its_own_file(made, tmp_path):
    d, model_dir = made
    c = tmp_path / "c"
    entry = imported(made, c)
    out = tmp_path / "out.safetensors"
    p = cli("export", entry["id"], out, cache_dir=c)
    assert p.returncode == 0, p.stderr
    assert out.stat().st_mode & 0o777 == 0o600  # a cache holds the prompt
    assert generated(out) == generated(d / "mlx.safetensors")
    # the token ids ride in mlx-lm's user metadata: the file comes back without its prompt
    again = tmp_path / "again"
    p = cli("import", out, "--model", model_dir, cache_dir=again)
    assert p.returncode == 0, p.stderr
    assert [e["key"] for e in entries(again)] == [entry["key"]]


def test_wrong_prompt_or_model_is_a_clear_error_and_stores_nothing(made, tmp_path):
    from tools.testing.model_builds import model_path

    d, model_dir = made
    c = tmp_path / "c"
    p = cli("import", d / "mlx.safetensors", "--model", model_dir, cache_dir=c)
    assert p.returncode == 2 and "--prompt-file" in p.stderr
    (tmp_path / "other.txt").write_text(PROMPT + " And one more clause.")
    p = cli("import", d / "mlx.safetensors", "--model", model_dir, "--prompt-file", tmp_path / "other.txt",
            cache_dir=c)
    assert p.returncode == 1 and "holds" in p.stderr and "nothing stored" in p.stderr, p.stderr
    other = model_path("tiny-gemma3")  # another model: mlx-lm's `model` metadata names tiny-llama
    p = cli("import", d / "mlx.safetensors", "--model", other, "--prompt-file", d / "prompt.txt", cache_dir=c)
    assert p.returncode == 1 and "another model" in p.stderr, p.stderr
    assert entries(c) == []


def test_export_never_replaces_a_file_unasked(made, tmp_path):
    d, model_dir = made
    c = tmp_path / "c"
    entry = imported(made, c)
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"mine")
    p = cli("export", entry["id"], out, cache_dir=c)
    assert p.returncode == 1 and "--force" in p.stderr
    assert out.read_bytes() == b"mine"
    assert cli("export", entry["id"], tmp_path / "out.bin", cache_dir=c).returncode == 2
    assert cli("export", entry["id"], out, "--force", cache_dir=c).returncode == 0
    assert out.stat().st_size > 1000
    assert sorted(f.name for f in tmp_path.iterdir()) == ["c", "out.safetensors"]  # no temporary left
