"""Sizes read the same way by every flag that takes one (``kvstore serve`` and the
maintenance commands), through their real argument parsers."""

from __future__ import annotations

import argparse

import pytest

from kvstore.adapters.server import setup_arg_parser as serve_flags
from kvstore.cli import gc as gc_command
from kvstore.cli.main import _parser
from kvstore.units import parse_size


@pytest.mark.parametrize("text,n", [("20GiB", 20 << 30), ("20G", 20 << 30), ("1.5g", 3 << 29), ("500MB", 500 << 20),
                                    ("64k", 64 << 10), ("1000B", 1000), ("2000000", 2000000), ("0", 0)])
def test_serve_and_gc_read_a_size_alike(text: str, n: int) -> None:
    serve = argparse.ArgumentParser()
    serve_flags(serve)
    assert serve.parse_args(["--max-disk-bytes", text, "--max-write-bytes-per-day", text]).max_disk_bytes == n
    assert _parser("gc", gc_command).parse_args(["gc", "--max-bytes", text]).max_bytes == n
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "20 GB of disk", "-5G", "ten"])
def test_a_bad_size_names_the_value(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    serve = argparse.ArgumentParser()
    serve_flags(serve)
    with pytest.raises(SystemExit):
        serve.parse_args([f"--max-disk-bytes={text}"])
    assert f"invalid size {text!r}" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["20", "1000", "1048575"])
def test_a_bare_number_under_a_mebibyte_is_refused_as_a_typo(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-bytes 20`` (a newcomer's 20G) emptied the cache: a bare number under 1 MiB is
    refused by every flag that takes a size, saying to add a unit or write B."""
    serve = argparse.ArgumentParser()
    serve_flags(serve)
    for parser, args in ((serve, [f"--max-disk-bytes={text}"]), (serve, [f"--max-write-bytes-per-day={text}"]),
                         (_parser("gc", gc_command), ["gc", f"--max-bytes={text}"])):
        with pytest.raises(SystemExit):
            parser.parse_args(args)
        err = capsys.readouterr().err
        assert "no unit" in err and f"{text}B" in err and f"{text}G" in err, err
    assert parse_size(f"{text}B") == int(text) and parse_size(f"{text}K") == int(text) << 10
    from kvstore.cli.vllm_mlx import split_args  # kvstore vllm-mlx serve's own flags: the same parser

    with pytest.raises(ValueError, match="no unit"):
        split_args(["model", "--max-disk-bytes", text])
    assert split_args(["model", f"--max-write-bytes-per-day={text}G"])[0] == {"max_write_bytes_per_day": int(text) << 30}
