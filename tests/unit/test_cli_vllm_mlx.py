"""kvstore.cli.vllm_mlx: ``kvstore vllm-mlx serve`` says where its disk tier is."""

from __future__ import annotations


def test_kvstore_vllm_mlx_serve_says_where_its_disk_tier_is() -> None:
    from kvstore.cli.vllm_mlx import disk_tier_line, split_args

    options, rest = split_args(["m", "--continuous-batching", "--cache-dir", "/data/kv", "--max-disk-bytes", "5000B"])
    line = disk_tier_line(options, rest)
    assert line.startswith("disk tier on: entries in /data/kv (at most 5,000 bytes, --persist all)"), line
    assert "batched engine" in line
    assert "SimpleEngine" in disk_tier_line(*split_args(["m"]))
