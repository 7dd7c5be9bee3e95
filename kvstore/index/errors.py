"""The index's error types, as the layers above it catch them.

The index is LMDB underneath and its failures are LMDB's exceptions; this module names
them once, so nothing above the index imports ``lmdb`` to catch them:
``IndexFailure`` is any failure of an index operation (an I/O error, a full disk or map, a
damaged file), ``DAMAGE`` the ones that say the file itself is damaged (the store then
switches its disk tier off: walking a damaged tree further can abort the process).
"""

from __future__ import annotations

import lmdb

IndexFailure = lmdb.Error
DAMAGE: tuple[type[Exception], ...] = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError,
                                       lmdb.InvalidError)

__all__ = ["DAMAGE", "IndexFailure"]
