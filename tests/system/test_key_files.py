"""The fleet secret and API-key files are files kvstore did not write: a FIFO or device
there is refused at once (it blocked the start forever), read through files.read_foreign."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.children import run_py


def test_a_fifo_as_secret_or_key_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "secret"
    os.mkfifo(fifo)
    got = run_py("""
        import argparse, json, sys
        from kvstore.shared.config import read_secret
        from kvstore.serve import tenants
        out = {}
        try:
            read_secret(json.loads(sys.argv[1]))
        except ValueError as e:
            out["secret"] = str(e)
        try:
            tenants.policy_from(argparse.Namespace(api_key=None, api_key_file=json.loads(sys.argv[1]), isolate_keys=False), {})
        except SystemExit as e:
            out["keys"] = str(e)
        print(json.dumps(out))
    """, str(fifo), timeout=60)
    assert "not a regular file" in got["secret"], got
    assert "not a regular file" in got["keys"], got
