"""The standing compatibility gate: vllm-mlx's own tests of ``MemoryAwarePrefixCache`` (and
of the scheduler's and the multimodal generator's use of it) pass on kvstore's class.

``tools/gates/upstream_vllm_mlx.py`` fetches them from the sdist of the installed vllm-mlx (once
per machine, into the user cache dir), runs them on vllm-mlx's class and on kvstore's (a
live disk tier, tiny-llama's identity), and compares: every test that passes on vllm-mlx's
class must pass on kvstore's, deliberate differences (``DELIBERATE``, in README.md) aside.
"""

from __future__ import annotations

from pathlib import Path

from tools.gates import upstream_vllm_mlx


def test_every_upstream_test_that_passes_on_vllm_mlx_passes_on_kvstore(tmp_path: Path) -> None:
    upstream, ours, regressions = upstream_vllm_mlx.gate(tmp_path)
    print(f"\n{upstream.summary()}\n{ours.summary()}")
    assert upstream.count("passed") >= 400, upstream.summary()  # the suites ran
    assert set(ours.results) == set(upstream.results), (set(ours.results) ^ set(upstream.results))
    assert not regressions, {t: ours.results[t] for t in regressions}
    index = tmp_path / "kvstore-cache" / "index"  # the kvstore run opened kvstore's store
    assert index.is_dir() and any(index.iterdir()), "the kvstore run never opened kvstore's store"
    readme = (Path(__file__).resolve().parent.parent.parent / "README.md").read_text()
    for test, why in upstream_vllm_mlx.DELIBERATE.items():
        assert test in readme and why in readme, test


def test_the_suites_are_downloaded_once_and_never_copied_into_the_repository() -> None:
    root = upstream_vllm_mlx.suites_dir()
    assert (root / "tests").is_dir() and upstream_vllm_mlx.upstream_dir() in root.parents
    repo = Path(__file__).resolve().parent.parent.parent
    theirs = {(root / s).read_bytes() for s in upstream_vllm_mlx.SUITES if (root / s).is_file()}
    assert len(theirs) >= 10
    assert not [p for p in repo.rglob("test_*.py") if p.read_bytes() in theirs]
