"""The standing compatibility gate: mlx-lm's own ``tests/test_server.py`` passes on kvstore.

``tools/gates/upstream_mlx_lm.py`` fetches the suite from the sdist of the installed mlx-lm on
PyPI (once per machine, into the user cache dir), runs it on plain mlx_lm.server and on
kvstore's server (kvstore's prompt cache, with a disk tier, and its routes patched in),
both on a local tiny model, and compares: every test that passes on mlx_lm.server must
pass on kvstore, deliberate differences (``DELIBERATE``, listed in docs/serve.md) aside.
"""

from __future__ import annotations

from pathlib import Path

from tools.gates import upstream_mlx_lm


def test_every_upstream_server_test_that_passes_on_mlx_lm_passes_on_kvstore(tmp_path: Path) -> None:
    upstream, ours, regressions = upstream_mlx_lm.gate(tmp_path)
    print(f"\n{upstream.summary()}\n{ours.summary()}")
    assert upstream.count("passed") >= 30, upstream.results  # the suite ran, on a model that loads
    assert set(ours.results) == set(upstream.results), (set(ours.results) ^ set(upstream.results))
    assert not regressions, {t: ours.results[t] for t in regressions}
    # the kvstore run used kvstore's prompt cache: its disk tier holds what the suite served
    index = tmp_path / "kvstore-cache" / "index"
    assert index.is_dir() and any(index.iterdir()), "the kvstore run never opened kvstore's store"
    docs = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    for test, why in upstream_mlx_lm.DELIBERATE.items():  # each deliberate difference is documented
        assert test in docs and why in docs, test


def test_the_suite_is_downloaded_once_and_never_copied_into_the_repository() -> None:
    path = upstream_mlx_lm.suite_path()
    assert path.is_file() and upstream_mlx_lm.upstream_dir() in path.parents
    assert path.stat().st_mtime == upstream_mlx_lm.suite_path().stat().st_mtime  # reused, not fetched again
    repo = Path(__file__).resolve().parents[2]
    assert not any(p.read_bytes() == path.read_bytes() for p in repo.rglob("test_server.py"))
