"""``kvstore serve``'s callers: API keys, and the ``cache_salt`` of every request.

Checked at the one place every request passes whatever route serves it (OpenAI's,
Anthropic's ``/v1/messages``, kvstore's own): ``admit``, which kvstore's handler
(``kvstore.serve.handler``) calls from its ``parse_request``, once the request line and
headers are read, before any ``do_*`` method runs.

- Keys (``Policy``; ``--api-key`` repeatable, ``--api-key-file``, ``$KVSTORE_API_KEYS``):
  a request without a valid key (``Authorization: Bearer KEY`` or ``x-api-key: KEY``) gets
  401 in its API's own error shape on every path but ``/health`` (``CORS`` preflights,
  ``OPTIONS``, carry no credentials and answer nothing but headers). Keys are compared as
  SHA-256 digests with ``hmac.compare_digest`` against every configured key (no early
  exit); only their digests are kept, never logged. No key configured: nothing checked.
- Body: a POST body is read and parsed here, once (``http.admit_body``: a 411 / 413 / 400 in
  the route's own shape for a body that cannot be used), and that object is what the route
  reads (mlx_lm.server's own ``json.loads`` of it included: ``http.ParsedOnce``).
- Salt: a POST body's ``cache_salt`` is validated (``salt.salt_of_body``: a 400 naming the
  field for anything but a non-empty string of at most 256 characters, before the route
  sees the request: nothing generated, nothing stored). With ``--isolate-keys`` every
  request is salted with its key's digest too (``salt.combine``). The salt then travels
  with the request to mlx_lm.server's generation thread in its ``RequestContext``
  (``kvstore.serve.context``): its ``_tokenize`` hands the tokens out as
  ``salt.SaltedTokens``, which ``LRUPromptCache`` reads; a ``BatchGenerator`` subclass
  (``salted_batches``) keeps each sequence's salt by uid and puts it back on the token lists
  it hands to ``insert_cache``. Nothing per request is kept in a thread-local.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Mapping

from .anthropic import error_body as anthropic_error
from .http import BodyError, admit_body, forget_body, send_json
from ..salt import Salt, SaltedTokens, SaltError, combine, salt_of, salt_of_body, tag
from ..escape import logger

log = logger("kvstore")
ENV_KEYS = "KVSTORE_API_KEYS"
OPEN_PATHS = frozenset({"/health"})
MAX_KEY_CHARS = 4096
PRINTABLE_ASCII = (0x21, 0x7E)  # what a key may hold: visible ASCII, no space


@dataclass(frozen=True)
class Policy:
    """Who may call: SHA-256 digests of the accepted keys (none: everyone), and whether each
    key's requests are salted with its digest (``isolate``)."""

    digests: tuple[bytes, ...] = field(default=(), repr=False)
    isolate: bool = False

    @classmethod
    def from_keys(cls, keys: list[str], isolate: bool = False) -> "Policy":
        bad = [i for i, k in enumerate(keys) if not k or len(k) > MAX_KEY_CHARS or any(c.isspace() for c in k)]
        if bad:
            raise ValueError(f"API key #{bad[0] + 1} is empty, longer than {MAX_KEY_CHARS} characters "
                             "or contains whitespace")
        odd = [i for i, k in enumerate(keys) if not all(PRINTABLE_ASCII[0] <= ord(c) <= PRINTABLE_ASCII[1] for c in k)]
        if odd:  # it could never match: http.server reads header values as Latin-1, clients send UTF-8 or refuse
            raise ValueError(f"API key #{odd[0] + 1} has a character outside printable ASCII: HTTP clients send a "
                             "key's bytes as they please (most refuse non-ASCII headers, others send UTF-8, which "
                             "the server reads as Latin-1), so no request could ever present it; use letters, "
                             "digits and punctuation (e.g. `openssl rand -hex 32`)")
        if isolate and not keys:
            raise ValueError("--isolate-keys needs API keys (--api-key, --api-key-file or $KVSTORE_API_KEYS)")
        return cls(tuple(dict.fromkeys(_digest(k) for k in keys)), isolate)

    @property
    def on(self) -> bool:
        return bool(self.digests)

    def accepts(self, key: str | None) -> bool:
        """Whether ``key`` is one of the configured keys; compares against all of them in
        constant time per key (digests: equal length whatever was sent)."""
        given = _digest(key if key is not None else "")
        ok = False
        for d in self.digests:
            ok |= hmac.compare_digest(given, d)
        return ok and key is not None

    def key_salt(self, key: str | None) -> Salt | None:
        """The salt ``--isolate-keys`` gives ``key``'s requests (None when not isolating)."""
        return b"apikey:" + _digest(key) if self.isolate and key is not None else None




def _digest(key: str) -> bytes:
    return hashlib.sha256(b"kvstore/api-key\0" + key.encode("utf-8", "surrogatepass")).digest()


# -- configuration ---------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("callers")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept requests carrying this key (Authorization: Bearer KEY or x-api-key: KEY); "
                        "repeatable; every endpoint but /health then needs one (default: $KVSTORE_API_KEYS, "
                        "comma-separated)")
    g.add_argument("--api-key-file", metavar="FILE", default=None,
                   help="accepted keys, one per line (# comments and blank lines ignored)")
    g.add_argument("--isolate-keys", action="store_true",
                   help="salt every request with a digest of its key: callers with different keys never "
                        "reuse each other's cached prompts (each keeps its own across restarts)")


def policy_from(ours: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Policy:
    """The ``Policy`` of ``--api-key`` / ``--api-key-file`` / ``$KVSTORE_API_KEYS``
    (the environment only when neither flag is given); SystemExit naming a bad one."""
    env = os.environ if environ is None else environ
    keys = list(ours.api_key or [])
    if ours.api_key_file:
        try:
            from ..files import read_foreign  # never blocks on a FIFO, regular files only

            # lines end at \n only (splitlines() also splits at \x0c, \x1c, \x85...: one line with a
            # control character in it became two keys); an editor's byte-order mark, CR and
            # surrounding spaces or tabs are not part of a key
            lines = [ln.strip(" \t\r") for ln in read_foreign(Path(ours.api_key_file), limit=1 << 20)
                     .decode("utf-8-sig").split("\n")]
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit(f"kvstore serve: cannot read --api-key-file: {e}") from None
        found = [ln for ln in lines if ln and not ln.startswith("#")]
        if not found:
            raise SystemExit(f"kvstore serve: --api-key-file {ours.api_key_file} holds no key")
        keys += found
    if not keys and env.get(ENV_KEYS, "").strip():
        keys = [k.strip() for k in env[ENV_KEYS].split(",") if k.strip()]
    try:
        return Policy.from_keys(keys, ours.isolate_keys)
    except ValueError as e:
        raise SystemExit(f"kvstore serve: {e}") from None


def warn_if_exposed(host: str | None, policy: Policy) -> bool:
    """Warn (True) when binding to a non-loopback address without any API key."""
    if policy.on or _loopback(host or "127.0.0.1"):
        return False
    log.warning("kvstore serve: listening on %s without an API key: anyone who can reach it may generate, "
                "read the cache statistics and probe the prompt cache for other callers' prompts; "
                "use --api-key (and --isolate-keys) or bind to 127.0.0.1", host)
    return True


def host_of(argv: list[str]) -> str | None:
    """mlx_lm.server's ``--host`` value in its arguments (None: its default, 127.0.0.1)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host", default=None)
    return p.parse_known_args(argv)[0].host


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- the request side ------------------------------------------------------------------


def presented_key(headers: Any) -> str | None:
    """The key a request carries: ``Authorization: Bearer KEY``, else ``x-api-key``."""
    auth = headers.get("Authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def is_anthropic(path: str) -> bool:
    return path.split("?")[0].startswith("/v1/messages")


def error_body(path: str, status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An error in the shape of the API ``path`` belongs to (Anthropic's for /v1/messages*,
    OpenAI's for the rest)."""
    if is_anthropic(path):
        return anthropic_error(status, message)
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    kind = "server_error" if status >= 500 else kind
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def request_salt(body: Any, key: str | None = None, policy: Policy | None = None) -> Salt | None:
    """The salt a request runs under: its body's ``cache_salt`` (validated: SaltError), with
    ``--isolate-keys`` (``policy``'s; None: no keys) combined with its key's. What a route
    that reads its own body calls."""
    policy = Policy() if policy is None else policy
    own = salt_of_body(body) if isinstance(body, dict) else None
    return combine(policy.key_salt(key), own)


def _send(handler: Any, status: int, body: dict[str, Any], close: bool) -> None:
    send_json(handler, status, body, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None, close=close)


def admit(handler: Any, policy: Policy, max_body_bytes: int | None = None) -> tuple[bool, Salt | None]:
    """The check every request passes once its headers are read: its key, its body (read
    and parsed once, at most ``max_body_bytes``: ``http.admit_body``), its salt. (False, None)
    when it was answered here (401, 411, 413, 400); else (True, the salt it runs under)."""
    forget_body(handler)
    path = handler.path.split("?")[0]
    if handler.command == "OPTIONS" or path in OPEN_PATHS:
        return True, None
    key = presented_key(handler.headers)
    if policy.on and not policy.accepts(key):
        msg = "missing API key: send Authorization: Bearer KEY or x-api-key: KEY" if key is None \
            else "invalid API key"
        _send(handler, 401, error_body(path, 401, msg, code="invalid_api_key"), close=True)
        return False, None
    if handler.command != "POST":
        return True, None
    try:  # read and parsed once, here: the object every route then gets (kvstore.serve.http)
        body = admit_body(handler, max_body_bytes)
    except BodyError as e:  # 411 / 413 leave the body unread: the connection cannot go on
        _send(handler, e.status, error_body(path, e.status, str(e), param=e.param, code=e.code),
              close=e.status in (411, 413))
        return False, None
    try:
        return True, request_salt(body, key, policy)
    except SaltError as e:
        _send(handler, 400, error_body(path, 400, str(e), param="cache_salt", code="invalid_cache_salt"), close=False)
        return False, None


def salted_batches(base: type) -> type:
    """``base`` (mlx-lm's BatchGenerator) keeping each sequence's salt by uid: what it is
    given as ``all_tokens`` (``SaltedTokens``) comes back on the token lists of
    ``extract_cache`` and of finished responses, which mlx_lm.server inserts."""

    class SaltedBatchGenerator(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._kvstore_salts: dict[int, Salt] = {}

        def insert_segments(self, segments: Any, max_tokens: Any = None, caches: Any = None,
                            all_tokens: Any = None, *args: Any, **kwargs: Any) -> Any:
            salts = [salt_of(t) for t in all_tokens] if all_tokens else []
            plain = [list(t) for t in all_tokens] if all_tokens else all_tokens
            uids = super().insert_segments(segments, max_tokens, caches, plain, *args, **kwargs)
            for uid, salt in zip(uids, salts):
                if salt is not None:
                    self._kvstore_salts[uid] = salt
            return uids

        def extract_cache(self, uids: Any) -> Any:
            got = super().extract_cache(uids)
            return {uid: (c, tag(k, self._kvstore_salts.get(uid))) if uid in self._kvstore_salts else (c, k)
                    for uid, (c, k) in got.items()}

        def next(self) -> Any:
            prompts, gens = super().next()
            for r in gens:
                salt = self._kvstore_salts.get(r.uid)
                if salt is not None and r.finish_reason is not None:
                    r.all_tokens = SaltedTokens(r.all_tokens or [], salt)
                    del self._kvstore_salts[r.uid]
            return prompts, gens

        def remove(self, uids: Any, *args: Any, **kwargs: Any) -> Any:
            got = super().remove(uids, *args, **kwargs)
            for uid in uids:
                self._kvstore_salts.pop(uid, None)
            return got

    SaltedBatchGenerator.__name__ = SaltedBatchGenerator.__qualname__ = base.__name__
    return SaltedBatchGenerator
