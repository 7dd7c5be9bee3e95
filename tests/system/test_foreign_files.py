"""Files kvstore did not write (issue 31.8): a model directory's files, reached through a
prompt-cache file's metadata or a record's model path, are read without ever blocking
(a FIFO there is refused, not waited on), and the identity's watch on the request path
costs the same whatever the model directory's tree holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.children import ROOT, child_env

from kvstore.identity import watch
from tools.testing.model_builds import model_path
from tools.testing.oracle import prefill

# Where a FIFO may sit in a model directory: what the identity reads (config, template,
# tokenizer), what mlx-lm's loader opens (the weights), and custom model code.
PLANTED = ["config.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors", "custom.py"]


def _model_with_fifo(tmp_path: Path, name: str) -> Path:
    """A copy of tiny-llama (with a ``model_file`` when the FIFO is custom code) whose
    ``name`` is a FIFO."""
    mdir = Path(shutil.copytree(model_path("tiny-llama"), tmp_path / f"model-{name}"))
    if name == "custom.py":
        cfg = json.loads((mdir / "config.json").read_text())
        (mdir / "config.json").write_text(json.dumps({**cfg, "model_file": "custom.py"}))
    (mdir / name).unlink(missing_ok=True)
    os.mkfifo(mdir / name, 0o600)
    return mdir


def _prompt_file(tmp_path: Path, tiny_llama, named_model: Path) -> Path:
    """An mlx-lm prompt-cache file with kvstore's token ids whose ``model`` metadata names
    ``named_model``."""
    from mlx_lm.models.cache import save_prompt_cache

    model, _ = tiny_llama
    tokens = [(7 * i + 3) % 200 + 5 for i in range(40)]
    path = tmp_path / "prompt.safetensors"
    save_prompt_cache(str(path), prefill(model, tokens),
                      {"model": str(named_model), "tokenizer_config": "{}", "kvstore_tokens": json.dumps(tokens)})
    return path


def _kvstore(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env=child_env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvstore {' '.join(args)} blocked ({timeout:.0f} s)")


@pytest.mark.parametrize("planted", PLANTED)
def test_import_never_blocks_on_a_fifo_the_metadata_names(tmp_path: Path, tiny_llama, planted: str) -> None:
    """``kvstore import`` of a file whose ``model`` metadata names a directory holding a
    FIFO finishes (the named directory has no identity here: the file is stored under
    --model's), and ``--model`` naming such a directory is refused naming the FIFO.
    Before: both blocked forever on the FIFO (config.json read with a blocking open, the
    weights opened by mlx-lm)."""
    fifo_dir = _model_with_fifo(tmp_path, planted)
    f = _prompt_file(tmp_path, tiny_llama, fifo_dir)
    cache = tmp_path / "cache"
    got = _kvstore("import", str(f), "--model", str(model_path("tiny-llama")), "--cache-dir", str(cache))
    assert got.returncode == 0 and "imported 40 tokens" in got.stdout, got.stderr
    refused = _kvstore("import", str(f), "--model", str(fifo_dir), "--cache-dir", str(cache))
    assert refused.returncode != 0 and planted in refused.stderr and "not a regular file" in refused.stderr, \
        (refused.stdout, refused.stderr)


def test_store_identity_of_a_directory_with_a_fifo_is_memory_only(tmp_path: Path) -> None:
    """A server given a model directory holding a FIFO serves memory-only, said once,
    and never blocks (run in a child: a blocked open would hang this process)."""
    fifo_dir = _model_with_fifo(tmp_path, "config.json")
    code = ("import json, sys; from kvstore import KVStore\n"
            "with KVStore(sys.argv[1]) as s: print(json.dumps(s.identity(sys.argv[2]) is None))")
    try:
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cache"), str(fifo_dir)], capture_output=True,
                           text=True, timeout=120, env=child_env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired:
        pytest.fail("KVStore.identity blocked on a FIFO in the model directory")
    assert p.stdout.strip() == "true" and "not a regular file" in p.stderr, (p.stdout, p.stderr)


def _code_tree(root: Path, n: int) -> Path:
    """tiny-llama with a ``model_file`` and ``n`` more ``*.py`` files in 10 subdirectories."""
    mdir = Path(shutil.copytree(model_path("tiny-llama"), root))
    cfg = json.loads((mdir / "config.json").read_text())
    (mdir / "config.json").write_text(json.dumps({**cfg, "model_file": "custom.py"}))
    (mdir / "custom.py").write_text("X = 1\n")
    for i in range(n):
        d = mdir / f"pkg{i % 10}"
        d.mkdir(exist_ok=True)
        (d / f"m{i}.py").write_text(f"V = {i}\n")
    return mdir


def test_watch_does_not_grow_with_the_model_tree(tmp_path: Path) -> None:
    """The identity's watch (taken on every fetch and insert) stats the same files for a
    ``model_file`` model with 10 or 2,000 other ``*.py`` files: the model file itself, the
    directory, its weights, config and tokenizer. Before: every ``*.py`` and directory of
    the tree (166 ms per call at 20,000 files)."""
    small, large = _code_tree(tmp_path / "small", 10), _code_tree(tmp_path / "large", 2000)
    names = {n: sorted(os.path.relpath(e[0], d) for e in watch(d)) for n, d in (("small", small), ("large", large))}
    assert names["small"] == names["large"], names
    assert "custom.py" in names["large"]
