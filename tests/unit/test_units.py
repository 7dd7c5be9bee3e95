"""Sizes read the same way by every flag that takes one (``kvstore serve`` and the
maintenance commands), through their real argument parsers."""

from __future__ import annotations

import argparse
import re

import pytest

from kvstore.serve.server import setup_arg_parser as serve_flags
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
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size '-0.1'"):  # not a fraction: read as a size
        memory_floor("-0.1")
    for text in ("1", "1.5", "2"):
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


# -- property tests (hypothesis; budget: the "kvstore" profile in tests/conftest.py) ----------------

import contextlib  # noqa: E402
import io  # noqa: E402
from fractions import Fraction  # noqa: E402

from hypothesis import example, given, settings, strategies as st  # noqa: E402

from kvstore import units  # noqa: E402

PARSERS = (units.parse_size, units.parse_duration, units.seconds, units.milliseconds, units.positive_seconds,
           units.memory_floor)
PREFIX = {"": 0, "k": 1, "K": 1, "m": 2, "M": 2, "g": 3, "G": 3, "t": 4, "T": 4, "p": 5, "P": 5}
SUFFIX = ["", "B", "b", "iB", "ib"]
NUMERALS = st.from_regex(r"\A[0-9]{0,45}(\.[0-9]{0,8})?\Z").filter(lambda t: t not in ("", ".") and t[0] != ".")
TEXT = st.one_of(st.text(), st.builds(lambda n, u: f"{n}{u}", NUMERALS,
                                      st.sampled_from(["", "k", "KiB", "gb", "B", "ib", "s", "d", "w", "e3", "E"])))


def _named(message: str, text: str) -> bool:
    return units._shown(text) in message or units._shown(text.strip()) in message


@given(TEXT, st.sampled_from(PARSERS))
@example("0.5", units.parse_size)
@example(".9", units.parse_size)
@example("9" * 400, units.parse_size)
@example("9" * 400, units.parse_duration)
@example("1e999", units.seconds)
@example("1e-400", units.memory_floor)
@example("\u0663G", units.parse_size)
def test_every_parser_returns_a_value_or_refuses_naming_the_input(text: str, parse) -> None:
    """Never another exception (OverflowError, ValueError from int(), ...), and a refusal
    always names what was given."""
    try:
        got = parse(text)
    except argparse.ArgumentTypeError as e:
        assert _named(str(e), text), (text, str(e))
        return
    assert isinstance(got, (int, float)) and not isinstance(got, bool) and got >= 0
    if parse is units.parse_size:
        assert isinstance(got, int) and got <= units.MAX_SIZE
    elif parse is not units.memory_floor:
        assert got <= units.MAX_SECONDS


@given(st.integers(0, units.MAX_SIZE), st.sampled_from(sorted(PREFIX)), st.sampled_from(SUFFIX))
def test_a_whole_size_reads_as_written(n: int, prefix: str, suffix: str) -> None:
    text = f"{n}{prefix}{suffix}"
    want = n * 1024 ** PREFIX[prefix]
    if suffix.lower() == "ib" and not prefix:  # "20ib": no such unit
        ok = False
    elif want > units.MAX_SIZE:
        ok = False
    else:
        ok = not (not prefix and not suffix and 0 < n < units.BARE_MIN)  # a bare typo under 1 MiB
    if ok:
        assert units.parse_size(text) == want
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            units.parse_size(text)


@given(st.decimals(min_value=0, max_value=10 ** 9, places=6, allow_nan=False, allow_infinity=False),
       st.sampled_from(sorted(PREFIX)), st.sampled_from(["", "B"]))
@example(__import__("decimal").Decimal("0.5"), "", "")
@example(__import__("decimal").Decimal("0.9"), "", "")
def test_a_fractional_size_is_never_silently_truncated(d, prefix: str, suffix: str) -> None:
    """A size is read exactly: with a unit it is the nearest byte (never 0 for a non-zero
    value); a bare number or one in B that is not a whole number of bytes is refused."""
    text = f"{d:f}{prefix}{suffix}"
    exact = Fraction(str(d)) * 1024 ** PREFIX[prefix]
    try:
        got = units.parse_size(text)
    except argparse.ArgumentTypeError as e:
        assert _named(str(e), text)
        assert (not prefix and exact.denominator != 1) or 0 < exact < 1 or exact > units.MAX_SIZE \
            or (not prefix and not suffix and 0 < exact < units.BARE_MIN), (text, str(e))
        return
    assert abs(got - exact) <= Fraction(1, 2) and (got == 0) == (exact == 0), (text, got)
    assert prefix or exact.denominator == 1


@given(st.integers(0, 10 ** 12), st.sampled_from(["", "s", "m", "h", "d", "w", "S", "D"]))
def test_a_whole_duration_reads_as_written(n: int, unit: str) -> None:
    want = n * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}[unit.lower()]
    text = f"{n}{unit}"
    if want > units.MAX_SECONDS:
        for parse in (units.parse_duration, units.seconds):
            with pytest.raises(argparse.ArgumentTypeError, match="over"):
                parse(text)
    else:
        assert units.parse_duration(text) == want == units.seconds(text)


@given(st.floats(min_value=0, max_value=units.MAX_SECONDS, allow_nan=False))
def test_seconds_read_every_float_as_written(f: float) -> None:
    assert units.seconds(repr(f)) == f
    if f > 0:
        assert units.positive_seconds(repr(f)) == f


@given(st.floats(min_value=0, max_value=1, exclude_max=True, allow_nan=False))
def test_a_memory_floor_fraction_reads_as_written(f: float) -> None:
    assert units.memory_floor(repr(f)) == f


def _flag_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    serve = argparse.ArgumentParser()
    serve_flags(serve)
    return serve, _parser("gc", gc_command)


_FLAG_PARSERS = _flag_parsers()


@settings(max_examples=60)  # ten flags per example, argparse's usage text for each refusal
@given(TEXT)
@example("0.5")
@example("9" * 400)
def test_every_size_and_duration_flag_reads_through_its_parser(text: str) -> None:
    """The flags of ``kvstore serve`` and ``kvstore gc`` / ``verify``: the parser's value, or
    argparse's usage error (exit 2) naming the flag; never a traceback."""
    serve, gc = _FLAG_PARSERS
    flags = [(serve, "--max-disk-bytes", "max_disk_bytes", units.parse_size),
             (serve, "--max-body-bytes", "max_body_bytes", units.parse_size),
             (serve, "--max-write-bytes-per-day", "max_write_bytes_per_day", units.parse_size),
             (serve, "--responses-max-bytes", "responses_max_bytes", units.parse_size),
             (serve, "--memory-floor", "memory_floor", units.memory_floor),
             (serve, "--shared-ttl", "shared_ttl", units.positive_seconds),
             (serve, "--shared-timeout", "shared_timeout", units.milliseconds),
             (gc, "--max-bytes", "max_bytes", units.parse_size),
             (gc, "--max-age", "max_age", units.parse_duration),
             (gc, "--blob-age", "blob_age", units.seconds)]
    for parser, flag, dest, parse in flags:
        try:
            want = parse(text)
        except argparse.ArgumentTypeError:
            want = None
        err = io.StringIO()
        argv = ([] if parser is serve else ["gc"]) + [f"{flag}={text}"]
        with contextlib.redirect_stderr(err):
            try:
                got = getattr(parser.parse_args(argv), dest)
            except SystemExit as e:
                assert e.code == 2 and want is None and f"argument {flag}: " in err.getvalue(), err.getvalue()
                assert _named(err.getvalue(), text) and "Traceback" not in err.getvalue(), err.getvalue()
                continue
        assert want is not None and got == want, (flag, text, got, want)
    from kvstore.cli.vllm_mlx import split_args  # kvstore vllm-mlx serve's own flags

    for flag, dest in (("--max-disk-bytes", "max_disk_bytes"), ("--max-write-bytes-per-day", "max_write_bytes_per_day")):
        try:
            want = units.parse_size(text)
        except argparse.ArgumentTypeError:
            with pytest.raises(ValueError, match=f"^{flag}: not a valid value"):
                split_args(["model", flag, text])
        else:
            assert split_args(["model", f"{flag}={text}"]) == ({dest: want}, ["model"])


@pytest.mark.parametrize("text", ["-5", "1.5", "", "１０", "2147483648", "1e3", "0x10"])
def test_a_count_bound_refuses_what_is_not_a_whole_number_from_0(text: str) -> None:
    from kvstore.units import count

    with pytest.raises(argparse.ArgumentTypeError, match=r"invalid count .*: a whole number from 0 below 2\*\*31$"):
        count(text)


def test_a_count_bound_reads_whole_numbers() -> None:
    from kvstore.units import count

    assert [count(t) for t in ("0", "5", " 1000 ", "2147483647")] == [0, 5, 1000, 2147483647]


@pytest.mark.parametrize("text", ["-5", "1.5", "", "１０", "٣", "2147483648", "0x10"])
def test_min_disk_hit_and_preload_refuse_what_is_not_a_whole_number_from_0(text: str) -> None:
    """``--min-disk-hit`` and ``--preload N`` read their number as ``units.whole`` does:
    ``int()`` took ``٣`` (an Arabic-Indic digit) and `` 5``, and their own -1 sentinel."""
    from kvstore.serve import server, startup

    parser = argparse.ArgumentParser(exit_on_error=False)
    server.setup_arg_parser(parser)
    startup.add_arguments(parser)
    with pytest.raises(argparse.ArgumentError, match=r"invalid number of tokens"):
        parser.parse_args(["--min-disk-hit", text])
    with pytest.raises(argparse.ArgumentError, match=r"expected pinned, auto or a number of entries >= 0"):
        parser.parse_args(["--preload", text])
    got = parser.parse_args(["--min-disk-hit", "0", "--preload", "12"])
    assert (got.min_disk_hit, got.preload) == (0, 12)
    assert parser.parse_args(["--preload", "pinned"]).preload == "pinned"
