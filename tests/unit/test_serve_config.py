"""``ServeConfig.store`` is the store ``kvstore serve`` runs: the drop-in's settings
(``options.DROP_IN``) with what its flags set, nothing restated."""

from __future__ import annotations

import argparse
from dataclasses import fields

from kvstore.options import DROP_IN


def _config(argv: list[str]):
    from kvstore.serve import model_names, server, startup, tenants
    from kvstore.serve.config import ServeConfig

    parser = argparse.ArgumentParser()
    server.setup_arg_parser(parser)
    startup.add_arguments(parser)
    tenants.add_arguments(parser)
    model_names.add_arguments(parser)
    ours = parser.parse_args(argv)
    return ServeConfig.from_args(ours, tenants.policy_from(ours, {}))


def test_the_served_store_is_the_drop_ins_with_the_flags(tmp_path) -> None:
    store = _config(["--cache-dir", str(tmp_path), "--max-disk-bytes", "1G", "--chunk-tokens", "128",
                     "--write-queue", "4", "--persist", "reused", "--memory-floor", "0.3",
                     "--min-disk-hit", "7"]).store
    set_here = {"cache_dir": str(tmp_path), "max_disk_bytes": 1 << 30, "chunk_tokens": 128, "queue_size": 4,
                "persist": "reused", "memory_floor": 0.3, "min_disk_hit": 7, "min_memory_hit": 7}
    for f in fields(store):
        want = set_here.get(f.name, getattr(DROP_IN, f.name))
        assert getattr(store, f.name) == want, (f.name, getattr(store, f.name), want)


def test_without_flags_the_served_store_is_the_drop_ins() -> None:
    from kvstore.serve.config import ServeConfig

    assert ServeConfig().store == DROP_IN
    got = _config([]).store  # --min-disk-hit's default rules memory hits too (one rule for the usage reported)
    assert {f.name for f in fields(got) if getattr(got, f.name) != getattr(DROP_IN, f.name)} == {"min_memory_hit"}
    assert got.min_memory_hit == got.min_disk_hit == DROP_IN.min_disk_hit
