"""Identities of one model directory, and which of them a newer one has replaced.

A model directory gets a new identity whenever something its KV depends on changes: its
files, the KV quantisation, or mlx-lm's model code (an mlx-lm upgrade, or two installs of
different versions: ``kvstore serve`` beside ``kvstore vllm-mlx serve`` with its pinned
mlx-lm). Entries of one identity are never served to another, so ``kvstore ls`` says what
differs between them, ``kvstore gc`` removes a superseded one's entries first, and a server
says at its start that an older identity holds entries it cannot use.

An identity is *superseded* when another identity of the same model directory started
storing after its last use: two identities in use side by side (two servers, two mlx-lm
versions) supersede neither. Salted identities (tenants) are left out: their components are
their model's, and their entries and counts are no other caller's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .escape import logger



@dataclass
class Usage:
    """One identity's entries: how many, their bytes (own segments), first stored, last used."""

    entries: int = 0
    bytes: int = 0
    first_created: float = float("inf")
    last_used: float = 0.0


def usage(entries: Iterable[tuple[bytes, Any]]) -> dict[str, Usage]:
    """Per identity (hex digest) over ``(key, EntryRecord)`` pairs (None records skipped)."""
    out: dict[str, Usage] = {}
    for _key, rec in entries:
        if rec is None:
            continue
        u = out.setdefault(rec.identity.hex(), Usage())
        u.entries += 1
        u.bytes += sum(s.length for s in rec.segments)
        u.first_created = min(u.first_created, rec.created)
        u.last_used = max(u.last_used, rec.last_used, rec.created)
    return out


def siblings(identities: dict[str, Any], hx: str) -> list[str]:
    """The other unsalted identities (hex) of ``hx``'s model directory, whose components differ."""
    me = identities.get(hx)
    if me is None or not me.path or me.get("salted"):
        return []
    from .misses import differing  # the miss log's module: `kvstore ls` imports it only for a model with entries

    path = me.path
    return sorted(other for other, info in identities.items()
                  if other != hx and info.path == path and not info.get("salted") and differing(info.info, me.info))


def superseded(identities: dict[str, Any], used: dict[str, Usage]) -> dict[str, str]:
    """Superseded identity (hex) -> the newest identity of its model directory that
    started storing after the superseded one's last use."""
    out: dict[str, str] = {}
    for hx, u in used.items():
        later = [(used[o].first_created, o) for o in siblings(identities, hx)
                 if o in used and used[o].first_created > u.last_used]
        if later:
            out[hx] = max(later)[1]
    return out


def what_differs(old: Any, new: Any) -> str:
    """The components that differ between two identity descriptions (``IdentityRecord`` or
    ``Identity.info``), with the mlx-lm versions when its model code is one of them:
    e.g. "code (mlx-lm 0.31.3 -> 0.32.2)"."""
    from .misses import differing

    a, b = getattr(old, "info", old), getattr(new, "info", new)
    parts = []
    for name in differing(a, b):
        va, vb = ((x.get("versions") or {}).get("mlx_lm") for x in (a, b))
        if name == "code" and va and vb and va != vb:
            name += f" (mlx-lm {va} -> {vb})"
        parts.append(name)
    return ", ".join(parts) or "unknown"


def log_unusable(index: Any, ident: Any) -> None:
    """Say in the log (a warning, once per derivation of ``ident``) which other identities
    of ``ident``'s model directory hold entries: this process cannot use them. Only the
    identity descriptions are read unless there is such an identity (then one scan of the
    records, no token ids)."""
    from .index import scan
    from .units import human_bytes

    if not siblings(index.identities(), ident.hex):
        return
    snap = scan(index, full=False)
    used = usage(snap.entries.items())
    for hx in siblings(snap.identities, ident.hex):
        if hx not in used:
            continue
        u = used[hx]
        logger("kvstore").warning(
            "kvstore: %d entr%s (%s) of %s were stored under another identity of this model directory, %s "
            "(%s differs): this process cannot use them. `kvstore ls` lists them, `kvstore gc --identity %s` "
            "removes them, and `kvstore gc --max-bytes` removes a superseded identity's entries first",
            u.entries, "y" if u.entries == 1 else "ies", human_bytes(u.bytes), ident.info.get("path"), hx[:12],
            what_differs(snap.identities[hx], ident.info), hx[:12])
