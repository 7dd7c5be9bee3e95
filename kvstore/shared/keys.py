"""Redis key names for the shared tier, with Redis Cluster hash tags.

``make_key("kvstore", "blob", "3f2a", tag="ab12")`` is ``"kvstore:{ab12}:blob:3f2a"``. Redis
Cluster hashes only the part inside the first ``{...}``, so every key made with the same
``tag`` lands in the same slot (one node, and a MULTI/EXEC over them is allowed), whatever
the other parts are. ``key_slot`` computes that slot here, exactly as the server does
(CRC16/XMODEM of the tag, mod 16384), so callers can check co-location without a cluster.

Guarantees: a key contains exactly one ``{...}`` (the tag) or none; parts and tags can
never open another tag (braces are rejected), so the slot is decided by the tag alone.
"""

from __future__ import annotations

SLOTS = 16384
_FORBIDDEN = set("{}\r\n\x00 ")


def make_key(prefix: str, *parts: str | int, tag: str | None = None) -> str:
    """``prefix:{tag}:part:part...`` (or ``prefix:part...`` with no tag).

    Raises ValueError for an empty prefix, tag or part, or one containing braces,
    whitespace or NUL.
    """
    _check("prefix", prefix)
    pieces = [prefix]
    if tag is not None:
        _check("tag", tag)
        pieces.append("{" + tag + "}")
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise ValueError(f"key parts must be str or int, got {type(part).__name__}")
        text = str(part)
        _check("key part", text)
        pieces.append(text)
    if len(pieces) == 1:
        raise ValueError("a key needs at least one part or a tag after the prefix")
    return ":".join(pieces)


def hash_tag(key: str | bytes) -> bytes:
    """The bytes Redis Cluster hashes for ``key``: the first non-empty ``{...}``, else all."""
    data = key.encode() if isinstance(key, str) else bytes(key)
    start = data.find(b"{")
    if start != -1:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            return data[start + 1:end]
    return data


def key_slot(key: str | bytes) -> int:
    """The Redis Cluster slot (0..16383) of ``key``."""
    return _crc16(hash_tag(key)) % SLOTS


def _crc16(data: bytes) -> int:
    """CRC16/XMODEM (poly 0x1021, init 0), the checksum Redis Cluster uses."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def _check(what: str, text: str) -> None:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what} must be a non-empty string")
    bad = _FORBIDDEN.intersection(text)
    if bad:
        raise ValueError(f"{what} {text!r} contains {''.join(sorted(bad))!r} "
                         "(no braces, whitespace or NUL in key names)")
