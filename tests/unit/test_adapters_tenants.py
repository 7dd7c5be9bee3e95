"""kvstore.adapters.tenants: where API keys come from, and what a bad source says."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_key_sources_and_their_errors(tmp_path: Path) -> None:
    import argparse

    from kvstore.adapters import tenants

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
