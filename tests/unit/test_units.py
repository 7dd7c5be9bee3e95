"""Sizes read the same way by every flag that takes one (``kvstore serve`` and the
maintenance commands), through their real argument parsers."""

from __future__ import annotations

import argparse
import re

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


def test_human_bytes_prints_whole_bytes_then_one_decimal_per_binary_unit() -> None:
    from kvstore.units import human_bytes

    assert [human_bytes(n) for n in (0, 1, 1023)] == ["0 B", "1 B", "1023 B"]
    assert [human_bytes(n) for n in (1024, 1536, (1 << 20) - 1)] == ["1.0 KiB", "1.5 KiB", "1024.0 KiB"]
    assert [human_bytes(n) for n in (1 << 20, 5 << 30, 3 << 40, 1 << 50)] == ["1.0 MiB", "5.0 GiB", "3.0 TiB", "1.0 PiB"]
    assert human_bytes(1 << 60) == "1024.0 PiB" and human_bytes(-2048) == "-2.0 KiB" and human_bytes(10.7) == "10 B"


@pytest.mark.parametrize("text,seconds", [("7d", 7 * 86400), ("12h", 43200), ("30m", 1800), ("45s", 45), ("2w", 14 * 86400),
                                          ("3600", 3600), (" 1.5H ", 5400), (".5m", 30), ("2.", 2), ("0", 0)])
def test_a_duration_reads_as_seconds(text: str, seconds: float) -> None:
    from kvstore.units import parse_duration

    assert parse_duration(text) == seconds and isinstance(parse_duration(text), float)


@pytest.mark.parametrize("text", ["", "7 days", "-1h", "1y", "h", "1hh"])
def test_a_bad_duration_names_the_value(text: str) -> None:
    from kvstore.units import parse_duration

    with pytest.raises(argparse.ArgumentTypeError, match=f"invalid duration {text!r}: use e.g. 7d, 12h, 30m, 45s$"):
        parse_duration(text)


def test_a_memory_floor_is_a_fraction_below_one_or_a_size() -> None:
    from kvstore.units import memory_floor

    assert memory_floor("0.2") == 0.2 and memory_floor("0") == 0.0 and memory_floor("0.999") == 0.999
    assert memory_floor("4G") == 4 << 30 and isinstance(memory_floor("4G"), int)
    for text in ("1", "1.5", "-0.1", "2"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"invalid memory floor {text!r}: a fraction below 1 "
                                                                       "(e.g. 0.2) or a size (e.g. 4G)") + "$"):
            memory_floor(text)
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size 'lots'"):
        memory_floor("lots")


def test_the_bare_number_bound_is_exactly_one_mebibyte() -> None:
    assert parse_size("1048576") == 1 << 20 and parse_size("0") == 0
    for text in ("1", "1048575"):
        with pytest.raises(argparse.ArgumentTypeError, match="no unit and is under 1 MiB"):
            parse_size(text)
