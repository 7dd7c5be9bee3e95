"""Start-up costs that must not grow back (issue 31.11): what ``kvstore ls`` imports, whatever
the store holds (what opening a cache directory looks at: tests/unit/test_cachedir.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.children import run_py


def test_ls_imports_no_lookup_or_identity_code(tmp_path: Path) -> None:
    """``kvstore ls`` (empty and missing directory) imports neither the disk tier's lookup
    and restore code nor the identity's (nor MLX): only what listing the index needs.
    Before: ``kvstore.cachedir`` imported ``kvstore.disk`` (and through it the identity,
    layouts, allocation code) for every command."""
    from kvstore.cachedir import open_disk

    d = tmp_path / "cache"
    open_disk(d).close()
    got = run_py("""
        import json, sys
        from kvstore.cli.main import main
        rc = main(["ls", "--cache-dir", json.loads(sys.argv[1])])
        heavy = ("kvstore.disk", "kvstore.identity", "kvstore.model_layout", "kvstore.alloc", "mlx", "mlx_lm")
        print(json.dumps({"rc": rc, "loaded": [m for m in heavy if m in sys.modules]}))
    """, str(d))
    assert got == {"rc": 0, "loaded": []}, got


def test_ls_of_a_stamped_index_imports_no_check_or_shared_tier_code(tmp_path: Path) -> None:
    """``kvstore ls`` on an index its clean stamp vouches for (a store closed cleanly, no
    entries) imports neither the checks an unstamped index needs (``index.checks``, the
    page walker, ``subprocess``) nor the shared tier's command code nor the comparison of
    identities, nor ``logging`` (nothing is logged): issue 47.5, what start-up compiles
    (PYTHONDONTWRITEBYTECODE) on every run. Before: ``index.core`` held the checks, ``ls``
    imported ``cli.shared_tier`` and ``superseded`` whatever it listed, and the package
    imported ``logging`` to filter kvstore's records."""
    from kvstore.cachedir import open_disk

    d = tmp_path / "cache"
    open_disk(d).close()
    got = run_py("""
        import json, sys
        from kvstore.cli.main import main
        rc = main(["ls", "--cache-dir", json.loads(sys.argv[1])])
        # kvstore.index.pages is read before LMDB opens: the format check (index.formats) reads it page by page
        unneeded = ("kvstore.index.checks", "subprocess", "kvstore.cli.shared_tier",
                    "kvstore.superseded", "logging")
        print(json.dumps({"rc": rc, "loaded": [m for m in unneeded if m in sys.modules]}))
    """, str(d))
    assert got == {"rc": 0, "loaded": []}, got


def test_a_record_of_kvstore_code_is_escaped_in_a_process_that_imported_only_what_logs_it(tmp_path: Path) -> None:
    """The log filter is added where kvstore's loggers are made (``escape.logger``), not at
    package import: a process whose only kvstore import is the index still gets the records
    of opening a damaged index escaped, on one line (the index's path holds ESC and a newline)."""
    from kvstore.cachedir import open_disk

    d = tmp_path / "cache\x1b]0;owned\x07\nforged"
    open_disk(d).close()
    (d / "index" / "clean").unlink()
    (d / "index" / "data.mdb").write_bytes(b"not an index " * 1000)
    got = run_py("""
        import json, logging, sys
        seen = []
        logging.getLogger("kvstore").addHandler(
            type("H", (logging.Handler,), {"emit": lambda s, r: seen.append(r.getMessage())})(logging.INFO))
        logging.getLogger("kvstore").setLevel(logging.INFO)
        from kvstore.index import Index
        from pathlib import Path
        Index(Path(json.loads(sys.argv[1]))).close()
        print(json.dumps(seen))
    """, str(d))
    assert got and all("\x1b" not in m and "\n" not in m and "\x07" not in m for m in got), got
    assert any("\\x1b]0;owned\\x07\\x0aforged" in m for m in got), got


def test_ls_of_an_unstamped_index_still_checks_it(tmp_path: Path) -> None:
    """Moving the checks out of ``index.core`` changed nothing about when they run: ``ls``
    on an index without its clean stamp (as after a crash) walks it in a child process
    and, finding it clean, stamps it again."""
    from kvstore.cachedir import open_disk

    d = tmp_path / "cache"
    open_disk(d).close()
    (d / "index" / "clean").unlink()
    got = run_py("""
        import json, sys
        from kvstore.cli.main import main
        rc = main(["ls", "--cache-dir", json.loads(sys.argv[1])])
        print(json.dumps({"rc": rc, "checked": "kvstore.index.checks" in sys.modules}))
    """, str(d))
    assert got == {"rc": 0, "checked": True}, got
    assert (d / "index" / "clean").is_file()


def test_store_without_a_shared_tier_does_not_import_it(tmp_path: Path) -> None:
    """A store opened with no shared tier configured (``$KVSTORE_SHARED`` unset) imports
    none of the shared tier's code (10 ms of a cold open here). Before: it imported the
    package to read the environment."""
    got = run_py("""
        import json, sys
        from kvstore import KVStore
        with KVStore(json.loads(sys.argv[1])) as s:
            print(json.dumps([m for m in sys.modules if m.startswith("kvstore.shared")]))
    """, str(tmp_path / "cache"), env={"KVSTORE_SHARED": ""})
    assert got == [], got


def test_persist_and_plan_load_no_mlx(tmp_path: Path) -> None:
    """The writer thread's work (``DiskTier.persist`` of host views and a ``Layout``) and a
    lookup plan run without MLX, mlx_lm or the codec: every layout fact disk asks is
    ``cachelayout``'s (issue 32.2). Before: persist imported ``codec`` (and MLX, about 3 s)
    to ask whether the layout could be chunked and cut."""
    got = run_py("""
        import json, sys
        import numpy as np
        from kvstore.layout import Layout
        from kvstore.disk import DiskTier, PersistJob
        from kvstore.identity import Identity
        from kvstore.keys import encode_tokens, key_of, root_key
        from kvstore.query import Query
        disk = DiskTier(json.loads(sys.argv[1]), chunk_tokens=4)
        ident = Identity.from_components({"test": "no-mlx"})
        toks = list(range(1, 11))
        enc = encode_tokens(toks)
        kv = np.zeros((1, 2, 10, 8), np.float32)
        job = PersistJob(ident, Query(enc, ident.digest, 4), {"0.k": ("F32", kv), "0.v": ("F32", kv)},
                         Layout.from_json([{"offset": 10, "class": "KVCache"}]))
        assert job.query.key == key_of(root_key(ident.digest), enc, 4)
        wrote, plan = disk.persist(job), disk.plan(ident, toks)
        print(json.dumps({"wrote": wrote > 0, "n": plan.n, "chunks": len(plan.chunks),
                          "loaded": [m for m in ("mlx", "mlx_lm", "kvstore.codec") if m in sys.modules]}))
    """, str(tmp_path))
    assert got == {"wrote": True, "n": 10, "chunks": 2, "loaded": []}, got
