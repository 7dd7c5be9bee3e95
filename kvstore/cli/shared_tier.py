"""``--shared URL`` for ``kvstore stats``, ``ls`` and ``gc``: the same questions asked of a
shared tier (Redis) instead of a cache directory. A separate code path: the local one is
untouched, and nothing here opens a cache directory; the commands import it only when
``--shared`` is given (the option itself is ``common.add_shared``). See
``kvstore.shared.admin``."""

from __future__ import annotations

import argparse
import time
from typing import Any

from . import common


def client(args: argparse.Namespace) -> Any:
    """A SharedClient for ``--shared`` (patient timeouts: maintenance, not a request)."""
    from ..shared import SharedClient, SharedConfig

    over: dict[str, Any] = {"connect_timeout": 2.0, "command_timeout": 10.0}
    if args.shared_prefix:
        over["prefix"] = args.shared_prefix
    try:
        config = (SharedConfig.from_url(args.shared, **over) if args.shared
                  else SharedConfig.from_env(**over))
    except ValueError as e:
        raise common.CLIError(str(e), 2) from None
    if config is None:
        raise common.CLIError("--shared needs a URL (or $KVSTORE_SHARED)", 2)
    c = SharedClient(config)
    if not c.ping():
        raise common.CLIError(f"shared tier {config.redacted()} does not answer")
    return c


def _finish(c: Any, found_complete: bool) -> int:
    if not found_complete:
        common.warn(f"the shared tier {c.config.redacted()} failed during the scan: the listing is partial")
        return 1
    return 0


def run_stats(args: argparse.Namespace) -> int:
    from ..shared import admin

    c = client(args)
    found = admin.listing(c)
    rows = found.by_identity()
    mem = admin.server_memory(c)
    out = {"server": c.config.redacted(), "prefix": c.config.prefix, "entries": len(found.entries),
           "chunks": len(found.chunks), "bytes": sum(r["bytes"] for r in rows), "hashes": len(found.hashes),
           "unreadable": len(found.unreadable), "server_memory": mem, "by_identity": rows}
    if args.json:
        common.print_json(out)
        return _finish(c, found.complete)
    hb, P = common.human_bytes, common.plural
    print(f"shared tier   {out['server']}  (prefix {out['prefix']})")
    print(f"values        {P(out['entries'], 'entry', 'entries')}, {P(out['chunks'], 'chunk')}, "
          f"{hb(out['bytes'])}; {P(out['hashes'], 'boundary hash', 'boundary hashes')}"
          + (f"; {out['unreadable']} unreadable" if out["unreadable"] else ""))
    if mem:
        cap = hb(mem["maxmemory"]) if mem["maxmemory"] else "no maxmemory (set one, with allkeys-lru)"
        print(f"server memory {hb(mem['used_memory'])} used of {cap}, policy {', '.join(mem['maxmemory_policy'])}")
    if rows:
        print()
        now = time.time()
        print(common.table([[r["identity"][:12], r["entries"], r["chunks"], r["tokens"], hb(r["bytes"]),
                             common.ago(r["newest"], now)] for r in rows],
                           ["IDENTITY", "ENTRIES", "CHUNKS", "TOKENS", "BYTES", "LAST PUBLISHED"],
                           right=(1, 2, 3, 4)))
    return _finish(c, found.complete)


def run_ls(args: argparse.Namespace) -> int:
    from ..shared import admin

    c = client(args)
    found = admin.listing(c)
    groups: dict[str, list[Any]] = {}
    for e in sorted(found.entries, key=lambda e: e.published, reverse=True):
        groups.setdefault(e.identity.hex(), []).append(e)
    data = {"server": c.config.redacted(), "n_entries": len(found.entries), "identities": [
        {"identity": hx, "entries": [{"id": common.short_id(e.key), "key": e.key.hex(), "tokens": e.tokens,
                                      "bytes": e.bytes, "chunks": len(e.chunks), "cache_type": e.cache_type,
                                      "created": e.created, "published": e.published} for e in es]}
        for hx, es in sorted(groups.items())]}
    if args.json:
        common.print_json(data)
        return _finish(c, found.complete)
    if not groups:
        print(f"no entries in {data['server']}")
        return _finish(c, found.complete)
    now = time.time()
    for i, g in enumerate(data["identities"]):
        if i:
            print()
        print(f"identity {g['identity'][:12]}")
        print(common.table([[e["id"], e["tokens"], common.human_bytes(e["bytes"]), e["chunks"], e["cache_type"],
                             common.ago(e["published"], now)] for e in g["entries"]],
                           ["ENTRY", "TOKENS", "SIZE", "CHUNKS", "TYPE", "PUBLISHED"], right=(1, 2, 3), indent="  "))
    print(f"\n{common.plural(data['n_entries'], 'entry', 'entries')} in {data['server']} "
          "(SIZE: the entry's own value; chunks are shared, see `kvstore stats --shared`)")
    return _finish(c, found.complete)


def run_gc(args: argparse.Namespace) -> int:
    from ..shared import admin

    if args.max_bytes is not None or args.missing_models:
        raise common.CLIError("with --shared, the budget is the server's maxmemory + allkeys-lru (or "
                              "--shared-ttl): use --identity and / or --max-age", 2)
    if not args.identity and args.max_age is None:
        raise common.CLIError("gc --shared needs --identity HEX and / or --max-age AGE", 2)
    c = client(args)
    known = {e.identity.hex(): None for e in admin.listing(c).entries} if args.identity else {}
    chosen = [common.resolve_identity(known, p) for p in args.identity]  # type: ignore[arg-type]
    res = admin.collect_garbage(c, identities=chosen, max_age=args.max_age, dry_run=args.dry_run)
    if args.json:
        common.print_json({"server": c.config.redacted(), "dry_run": res.dry_run, "entries": len(res.entries),
                           "chunks": res.chunks, "hashes": res.hashes, "fields": res.fields, "bytes": res.bytes,
                           "removed": [{"key": e.key.hex(), "identity": e.identity.hex(), "tokens": e.tokens,
                                        "published": e.published} for e in res.entries]})
        return _finish(c, res.complete)
    verb = "would remove" if res.dry_run else "removed"
    now = time.time()
    for e in res.entries:
        print(f"{verb} {common.short_id(e.key)}  identity {e.identity.hex()[:12]}  {e.tokens} tokens  "
              f"published {common.ago(e.published, now)}")
    P = common.plural
    print(f"{'would free' if res.dry_run else 'freed'} {common.human_bytes(res.bytes)}: "
          f"{P(len(res.entries), 'entry', 'entries')}, {P(res.chunks, 'chunk')}, "
          f"{P(res.hashes, 'boundary hash', 'boundary hashes')}, "
          f"{P(res.fields, 'field')} of values already gone in {c.config.redacted()}"
          + (" (dry run: nothing changed)" if res.dry_run else ""))
    return _finish(c, res.complete)
