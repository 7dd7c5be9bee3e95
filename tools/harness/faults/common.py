"""Constants, sizes and the small helpers every part of the fault harness shares."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[3]   # the repository (tools/harness/faults/common.py)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CHUNK = 32           # KVStore(chunk_tokens=...) everywhere: small blobs, many of them
EXTRA_TOKEN = 65     # token appended after a restored prefix for the oracle
N_GEN = 3            # greedy steps the oracle compares
VOCAB = 256          # prompts use the byte tokens of the tiny models

# trials per kind and size; "ci" is the subset tests/system/test_faults.py runs
SIZES: dict[str, dict[str, Any]] = {
    "full": dict(crash=240, crash_lineage=6, blob=720, lmdb=300, lmdb_live=40, full_disk=12,
                 conc_seconds=60, conc_procs=4, conc_threads=4, templates=3, huge_fetch=2_000_000,
                 huge_insert=100_000, hostile_all=1, shared_trials=160, shared_cluster_trials=48, shared_entries=8),
    "quick": dict(crash=24, crash_lineage=4, blob=60, lmdb=30, lmdb_live=6, full_disk=3,
                  conc_seconds=15, conc_procs=4, conc_threads=4, templates=2, huge_fetch=2_000_000,
                  huge_insert=100_000, hostile_all=1, shared_trials=24, shared_cluster_trials=8, shared_entries=6),
    "ci": dict(crash=8, crash_lineage=4, blob=24, lmdb=16, lmdb_live=2, full_disk=1,
               conc_seconds=8, conc_procs=4, conc_threads=4, templates=1, huge_fetch=200_000,
               huge_insert=20_000, hostile_all=0, shared_trials=8, shared_cluster_trials=2, shared_entries=4),
}

KINDS = ("crash", "corruption", "full_disk", "permissions", "concurrency", "bad_input", "hostile", "shared")


def exc_info(where: str, e: BaseException) -> dict:
    """An exception as JSON: where, type, message and the end of its traceback."""
    return {"where": where, "type": type(e).__name__, "msg": str(e)[:500],
            "tb": "".join(traceback.format_exception(type(e), e, e.__traceback__))[-3000:]}


class LogCapture(logging.Handler):
    """Collects warnings of the ``kvstore`` logger (what an operator would see)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append(f"{record.levelname}: {record.getMessage()}"[:400])
        except Exception:
            pass

    def __enter__(self) -> "LogCapture":
        lg = logging.getLogger("kvstore")
        lg.addHandler(self)
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
        return self

    def __exit__(self, *a: Any) -> None:
        logging.getLogger("kvstore").removeHandler(self)

    def has(self, text: str) -> bool:
        return any(text in r for r in self.records)


# ================================================================ worker operations
# Each runs inside a worker process and returns a JSON-able dict. ``emit`` sends an event
# line to the parent at once (crash workers report progress through it).

Emit = Callable[[dict], None]


def guard(where: str, escaped: list, fn: Callable, *a: Any, **kw: Any) -> Any:
    """``fn(*a, **kw)``; an exception is appended to ``escaped`` (as ``exc_info``) and None returned."""
    try:
        return fn(*a, **kw)
    except Exception as e:
        escaped.append(exc_info(where, e))
        return None


def decode(b: bytes) -> list[int]:
    """Token ids as the index stores them -> a list."""
    from kvstore.keys import decode_tokens
    return decode_tokens(b)
