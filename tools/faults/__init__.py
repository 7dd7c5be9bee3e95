"""Fault harness: a crash, a damaged file, a full disk or a bad call costs kvstore at most a miss.

Usage::

    python -m tools.faults                    # full size (the figures in tools/faults_results/)
    python -m tools.faults --quick            # a small run (a few minutes)
    python -m tools.faults --json FILE        # also write the figures as JSON
    python -m tools.faults --only crash,bad_input --seed 3 -v

Every fault kind counts, per trial, ``wrong_restores`` (a fetch hit whose cache fails the
oracle), ``escaped_exceptions`` (an exception that reached the caller of a KVStore method, or
a traceback out of ``verify``), ``crashes`` (a process the harness did not kill died by a
signal: LMDB segfault / SIGBUS) and ``entries_lost`` (an entry the store must still hold but
does not serve in full). All four must be 0.

What is checked after every fault ("the check", run in a separate checker process that
opens the directory fresh):
- every entry the index still claims (``Index.entries()``) is fetched by its stored token
  ids; a hit must pass the restored-equals-cold oracle (``tools/oracle.py``, tiny models,
  tolerance mode) *and* match a fresh prefill of the same tokens layer by layer (KV
  layers; synthetic caches are compared bit for bit with their deterministic regeneration);
  a hit whose arrays are bit-identical to a cache that already passed is not re-run;
- a claimed entry that misses (or only partly hits) must be explained: ``verify`` reports
  it (or one of its chunks), or the fault targeted it; otherwise it is an
  ``unexplained_miss``;
- ``maintenance.verify`` runs before the fetches (what is left), then ``verify(fix=True)``,
  then ``verify`` again, which must be clean (``verify_unclean`` otherwise); a reopened
  store must then serve every remaining entry in full from disk (``post_fix_misses``).

Fault kinds:
- ``crash``: kill -9 of a worker process at a random moment inside insert+flush, inside a
  write-behind flush, inside gc and inside ``verify --fix`` (the API, and the CLI when it is
  installed), plus mixed sequences. Directories live for several trials, so crash residue
  accumulates. An entry whose insert+flush returned before the kill must survive (entries
  gc chose to evict and entries the trial damaged on purpose are excused).
- ``corruption``: byte flips, truncation, deletion, zeroed ranges, swaps and stray files
  in blobs; flips, zeroed pages, truncation, deletion and garbage in ``index/data.mdb`` and
  ``lock.mdb``; single bit flips written through LMDB into one stored value (an entry or
  chunk record, token ids, a trie edge, a counter: what a flip LMDB cannot detect looks
  like); and ``live`` flips of data.mdb under an open store that must keep serving from
  memory. An entry whose blobs were not damaged must survive a blob fault. A damaged index
  may give a clear error (StoreOpenError), be moved aside at open (the documented
  recovery, which must be logged) or degrade to misses, never a crash or a wrong hit.
- ``full_disk``: the cache directory on a 4 MiB tmpfs mounted by the harness, filled by a
  filler file of random size and then by the store itself: serving continues from memory,
  every failed write is counted in ``stats()["write_errors"]``, nothing half-written is
  indexed, and writes resume once the filler is removed.
- ``permissions``: missing directory, a file in the way, read-only mounts, no permission
  (a worker running as ``nobody``), unusable ``index/`` or ``blobs/``: a clear
  ``StoreOpenError`` naming the problem, or (``on_disk_error="memory"``, and the
  LRUPromptCache drop-in) a warning and memory-only serving.
- ``concurrency``: 4 processes x 4 threads inserting, fetching, gc-ing and verifying one
  directory (synthetic caches checked bit for bit on every hit, tiny-llama caches through the
  oracle), then the check.
- ``bad_input``: empty, non-integer, negative, out-of-range and out-of-vocabulary token
  lists, enormous token lists, caches of the wrong length or classes, caches from another
  model (other layer classes, or the same classes with other KV heads, head_dim or dtype):
  a ValueError/TokenError naming the problem, a documented miss, or (a cache that does not
  fit the model) a documented refusal: counted in ``stats()["unpersistable"]``, warned, kept
  in memory only. The store (index records, blob files; the memory tier too for errors and
  misses) is unchanged.

The harness needs root for tmpfs mounts and for dropping to ``nobody``; without it those
cases are reported as skipped.
"""

from __future__ import annotations

from .check import Tally, cache_digest, check_store, logical_dump
from .common import CHUNK, KINDS, ROOT, SIZES
from .damage import damage_file
from .harness import Ctx, environment, run, table
from .kinds import RUNNERS
from .synth import Zoo, random_prompt, syn_cache, syn_check, syn_identity
from .worker import Checker, Pool, Worker, WorkerDied, worker_main

__all__ = ["CHUNK", "KINDS", "ROOT", "RUNNERS", "SIZES", "Checker", "Ctx", "Pool", "Tally", "Worker", "WorkerDied",
           "Zoo", "cache_digest", "check_store", "damage_file", "environment", "logical_dump", "random_prompt",
           "run", "syn_cache", "syn_check", "syn_identity", "table", "worker_main"]
