"""kvstore.serve.tenants: where API keys come from, and what a bad source says."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_key_sources_and_their_errors(tmp_path: Path) -> None:
    import argparse

    from kvstore.serve import tenants

    p = argparse.ArgumentParser()
    tenants.add_arguments(p)
    f = tmp_path / "keys"
    f.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n")
    pol = tenants.policy_from(p.parse_args(["--api-key", "flag-key", "--api-key-file", str(f)]),
                              {"KVSTORE_API_KEYS": "env-key"})
    assert [pol.accepts(k) for k in ("flag-key", "file-key-1", "file-key-2", "env-key", "", None, "file-key")] \
        == [True, True, True, False, False, False, False]
    assert "flag-key" not in repr(pol)
    assert tenants.policy_from(p.parse_args([]), {"KVSTORE_API_KEYS": "a-key,b-key"}).accepts("b-key")
    assert not tenants.policy_from(p.parse_args([]), {}).on
    with pytest.raises(SystemExit, match="--isolate-keys needs API keys"):
        tenants.policy_from(p.parse_args(["--isolate-keys"]), {})
    f.write_text("# nothing\n")
    with pytest.raises(SystemExit, match="holds no key"):
        tenants.policy_from(p.parse_args(["--api-key-file", str(f)]), {})
    with pytest.raises(SystemExit, match="cannot read"):
        tenants.policy_from(p.parse_args(["--api-key-file", str(tmp_path / "none")]), {})
    with pytest.raises(SystemExit, match="whitespace"):
        tenants.policy_from(p.parse_args(["--api-key", "two words"]), {})
    iso = tenants.policy_from(p.parse_args(["--api-key", "k1-key", "--api-key", "k2-key", "--isolate-keys"]), {})
    assert iso.key_salt("k1-key") != iso.key_salt("k2-key") and iso.key_salt("k1-key") == iso.key_salt("k1-key")
    assert [tenants.host_of(a) for a in (["--host", "0.0.0.0"], ["--port", "1"], ["--host=::1"])] == \
        ["0.0.0.0", None, "::1"]
    assert [tenants._loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3", "example.org")] \
        == [True, True, True, False, False, False]


# -- property tests of the key sources (hypothesis; tests/conftest.py's profile) -------------------

import argparse  # noqa: E402

from hypothesis import example, given, strategies as st  # noqa: E402

KEYISH = st.text(st.characters(codec="utf-8") | st.sampled_from(list("\x0b\x0c\x1c\x1d\x1e\x85\u2028\r\t ,#")),
                 max_size=40)


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("keyfiles")  # one directory for every example


def _file_keys(data: bytes) -> list[str] | None:
    """What a key file means: its lines (\\n or \\r\\n; a leading BOM dropped), trimmed of
    spaces and tabs, without blank and # lines; None when it is not UTF-8."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    lines = [ln.strip(" \t\r") for ln in text.split("\n")]
    return [ln for ln in lines if ln and not ln.startswith("#")]


@given(st.one_of(st.binary(max_size=80), st.lists(KEYISH, max_size=4).map(lambda ks: "\n".join(ks).encode())))
@example(b"abc-key\x1cdef-key\n")  # a control character inside a line: one bad key, never two keys
@example(b"abc-key\x0cdef-key\n")
@example("\ufeffgood-key\r\n# note\n\n".encode())
@example(b"\xff\xfe")
def test_a_key_file_reads_as_its_lines_or_is_refused(files_dir: Path, data: bytes) -> None:
    """Every key accepted is a line of the file as written; anything else ends the start
    with a message (SystemExit naming the file or the key's number, never the key), not
    another exception, and a line is never split into keys the file did not hold."""
    from kvstore.serve import tenants

    f = files_dir / "keys"
    f.write_bytes(data)
    try:
        policy = tenants.policy_from(argparse.Namespace(api_key=[], api_key_file=str(f), isolate_keys=False), {})
    except SystemExit as e:
        assert isinstance(e.code, str) and e.code.startswith("kvstore serve: "), e.code
        want = _file_keys(data)
        assert want is None or not want or any(
            not k.isascii() or not k.isprintable() or " " in k or len(k) > tenants.MAX_KEY_CHARS for k in want), \
            (data, e.code)
        return
    want = _file_keys(data)
    assert want and all(policy.accepts(k) for k in want), (data, want)
    assert len(policy.digests) == len(set(want))


@given(st.lists(KEYISH, max_size=4), st.booleans())
def test_keys_are_printable_ascii_or_refused_by_number(keys: list[str], isolate: bool) -> None:
    from kvstore.serve import tenants

    try:
        policy = tenants.Policy.from_keys(keys, isolate)
    except ValueError as e:
        assert any(not k or not k.isascii() or not k.isprintable() or " " in k or len(k) > 4096 for k in keys) \
            or (isolate and not keys), (keys, str(e))
        # a key is never repeated in an error (keys of 8 or more characters: a shorter one, as
        # "4096" or "ASCI", can be a word of the message itself; one failed run of that kind)
        assert not any(k in str(e) for k in keys if len(k) >= 8), "a key is never repeated in an error"
        return
    assert all(policy.accepts(k) for k in keys) and not policy.accepts(None)
    assert all(not policy.accepts(k + "x") for k in keys if k + "x" not in keys)


@given(st.dictionaries(st.sampled_from(["Authorization", "x-api-key"]), KEYISH | st.builds(lambda k: "Bearer " + k, KEYISH)))
def test_a_presented_key_is_read_from_any_header_text(headers: dict[str, str]) -> None:
    from kvstore.serve import tenants

    got = tenants.presented_key(headers)
    assert got is None or (got and got == got.strip() and (got in headers.get("Authorization", "") or
                                                           got == headers.get("x-api-key", "").strip()))
