"""The index of a cache directory: one LMDB environment, read and written in records.

``core`` opens it (shared per process, checked unless a clean stamp vouches for it,
salvaged when damaged) and runs transactions; ``checks`` is what an open runs when the
stamp does not vouch for the file (the crash check, the walk in a child, the salvage);
``txn`` reads and writes records inside one (``Reader``, ``WriteTxn``); ``trie`` is the
trie over token prefixes the lookup walks; ``pages`` walks LMDB's pages without LMDB, for
damaged files; ``formats`` finds a store of another format and sets it aside; ``marks`` are the writer marks; ``scan`` reads every record in one transaction; ``errors`` names the errors its operations raise.
"""

from .core import CORRUPTION, FormatError, Index, IndexOpenError, chunk_size
from .errors import DAMAGE, IndexFailure
from .scan import IndexRecords, scan
from .txn import DBS, Reader, WriteTxn

__all__ = ["chunk_size", "CORRUPTION", "DAMAGE", "FormatError", "DBS", "Index", "IndexFailure", "IndexOpenError", "Reader", "IndexRecords", "WriteTxn",
           "scan"]
