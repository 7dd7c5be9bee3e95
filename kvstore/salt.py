"""Salted reuse: a ``cache_salt`` splits the prompt cache into tenants that never share KV.

A prefix cache is a timing side channel: a hit answers in a fraction of a cold prefill, so
anyone who may send prompts can test whether someone else already sent a given prefix.
A salt closes it between callers that do not share one: ``salted(identity, salt)`` is
another identity whose digest is a keyed BLAKE2b of the model's digest under a key
derived from the salt. Every key kvstore makes (memory tier, the chained disk keys, the
shared tier's names) is rooted in the identity digest, so an entry written under one salt
is never found, not even partly, by a lookup under another salt or under none; no salt
(None) leaves the identity, and so every key, exactly as before.

Guarantees: ``check_salt`` accepts a non-empty ``str`` of at most ``MAX_SALT_CHARS``
characters (or ``bytes`` of at most ``MAX_SALT_BYTES``, from the Python API) and raises
``SaltError`` naming the field for anything else; the salt itself is never stored (only
digests derived from it). ``SaltedTokens`` carries a salt with a token list through code
that only slices, copies and appends (mlx_lm.server's generation thread).
"""

from __future__ import annotations

import hashlib
from typing import Any, Hashable, Iterable, Mapping, SupportsIndex, overload

from .identity import Identity

FIELD = "cache_salt"
MAX_SALT_CHARS = 256
MAX_SALT_BYTES = 1024
_DOMAIN = b"kvstore/cache_salt/v1\0"
_PERSON = b"kvstore-salt-v1"

Salt = str | bytes


class SaltError(ValueError):
    """A salt that is not a non-empty string of bounded length; says which field and why."""


def check_salt(salt: Any, field: str = FIELD) -> Salt | None:
    """``salt`` if it is None, a non-empty ``str`` of at most ``MAX_SALT_CHARS`` characters
    or non-empty ``bytes`` of at most ``MAX_SALT_BYTES``; else SaltError naming ``field``."""
    if salt is None:
        return None
    if isinstance(salt, str):
        if not salt:
            raise SaltError(f"{field} must be a non-empty string")
        if len(salt) > MAX_SALT_CHARS:
            raise SaltError(f"{field} must be at most {MAX_SALT_CHARS} characters, got {len(salt)}")
        return salt
    if isinstance(salt, (bytes, bytearray)):
        if not salt or len(salt) > MAX_SALT_BYTES:
            raise SaltError(f"{field} must be 1 to {MAX_SALT_BYTES} bytes, got {len(salt)}")
        return bytes(salt)
    raise SaltError(f"{field} must be a string, got {_json_type(salt)}")


def salt_of_body(body: Mapping[str, Any]) -> str | None:
    """The validated ``cache_salt`` of a JSON request body (None when absent); SaltError
    (a 400 for the caller) for a present one that is not a non-empty bounded string."""
    if FIELD not in body:
        return None
    value = body[FIELD]
    if not isinstance(value, str):  # JSON null, numbers, lists, ...: never a salt
        raise SaltError(f"{FIELD} must be a string, got {_json_type(value)}")
    got = check_salt(value)
    assert isinstance(got, str)
    return got


def combine(outer: Salt | None, inner: Salt | None) -> Salt | None:
    """One salt from two (``--isolate-keys``: the key's, then the request's), unambiguous:
    the outer salt's digest is fixed-length."""
    if outer is None:
        return inner
    head = b"kvstore/outer\0" + salt_key(outer)
    return head if inner is None else head + salt_key(inner)


def salt_key(salt: Salt) -> bytes:
    """32 bytes derived from ``salt`` (domain-separated SHA-256): the BLAKE2b key."""
    data = salt.encode("utf-8", "surrogatepass") if isinstance(salt, str) else bytes(salt)
    return hashlib.sha256(_DOMAIN + data).digest()


def salted_digest(digest: bytes, salt: Salt) -> bytes:
    """The identity digest of ``digest`` under ``salt`` (keyed BLAKE2b, same length)."""
    return hashlib.blake2b(digest, key=salt_key(salt), digest_size=len(digest), person=_PERSON).digest()


def salted(ident: Identity | None, salt: Salt | None) -> Identity | None:
    """``ident`` itself without a salt; else the identity its entries under ``salt`` are
    filed under: same description (layout, path: checks and maintenance work as for
    ``ident``), marked salted and named so, a digest that shares no key with ``ident``."""
    if ident is None or salt is None:
        return ident
    info = dict(ident.info, salted=True, name=f"{ident.name} (salted)")
    return Identity(salted_digest(ident.digest, salt), info)


def memory_key(model: Hashable, salt: Salt | None) -> Hashable:
    """The memory tier's key for a model without an identity (served from memory only)."""
    return model if salt is None else ("kvstore-salted", model, salt_key(salt))


class SaltedTokens(list):
    """A token list with a ``salt``: slices and copies keep it, so it travels with a
    request's tokens through code that slices, copies and appends them."""

    __slots__ = ("salt",)

    def __init__(self, tokens: Iterable[int] = (), salt: Salt | None = None) -> None:
        super().__init__(tokens)
        self.salt = salt

    @overload
    def __getitem__(self, i: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> "SaltedTokens": ...

    def __getitem__(self, i: Any) -> Any:
        got = super().__getitem__(i)
        return SaltedTokens(got, self.salt) if isinstance(i, slice) else got

    def copy(self) -> "SaltedTokens":
        return SaltedTokens(self, self.salt)

    def __reduce__(self) -> Any:  # pickled with its salt (mlx_lm.server shares requests so)
        return (SaltedTokens, (list(self), self.salt))


def tag(tokens: Iterable[int], salt: Salt | None) -> list[int]:
    """``tokens`` carrying ``salt`` (a ``SaltedTokens``); a plain list when there is none."""
    if salt is None:
        return tokens if isinstance(tokens, list) and not isinstance(tokens, SaltedTokens) else list(tokens)
    return SaltedTokens(tokens, salt)


def salt_of(tokens: Any) -> Salt | None:
    """The salt ``tokens`` carry (``SaltedTokens``), else None."""
    return getattr(tokens, "salt", None) if isinstance(tokens, SaltedTokens) else None


def _json_type(v: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "number", float: "number", list: "array",
            dict: "object"}.get(type(v), type(v).__name__)
