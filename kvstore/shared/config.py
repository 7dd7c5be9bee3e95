"""Where the shared tier lives and how patiently to talk to it: ``SharedConfig``.

``SharedConfig.from_url`` parses ``redis://[user:pass@]host:port/db``, ``rediss://`` (TLS),
``redis+cluster://host:port[,host:port...]`` and ``rediss+cluster://`` (Redis Cluster; or
``cluster=True``), with options from the query string (``?prefix=team-a&ttl=3600``) or from
keyword overrides. Credentials come from the URL, else from ``KVSTORE_SHARED_USER`` /
``KVSTORE_SHARED_PASSWORD``; keyword overrides beat both.

Guarantees: parsing does no I/O and needs no Redis client; a bad URL or option raises
``ValueError`` naming the problem; neither that message, ``repr()`` nor ``redacted()`` ever
contains the user name or the password.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping
from urllib.parse import parse_qsl, unquote

ENV_URL = "KVSTORE_SHARED"
ENV_USER = "KVSTORE_SHARED_USER"
ENV_PASSWORD = "KVSTORE_SHARED_PASSWORD"
ENV_SECRET = "KVSTORE_SHARED_SECRET"
ENV_SECRET_FILE = "KVSTORE_SHARED_SECRET_FILE"
MIN_SECRET_BYTES = 16

SCHEMES = {  # scheme -> (tls, cluster)
    "redis": (False, False),
    "rediss": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
}
DEFAULT_PORT = 6379
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-]+")  # no braces (hash tags), colons or spaces

# query-string option -> (field name, parser)
_QUERY_OPTIONS: dict[str, tuple[str, Any]] = {
    "prefix": ("prefix", str),
    "connect_timeout": ("connect_timeout", float),
    "command_timeout": ("command_timeout", float),
    "ttl": ("ttl", float),
    "fetch_deadline": ("fetch_deadline", float),
    "publish_deadline": ("publish_deadline", float),
    "flush_deadline": ("flush_deadline", float),
    "max_value_bytes": ("max_value_bytes", int),
    "ca_file": ("tls_ca_file", str),
    "cluster": ("cluster", lambda v: _parse_bool("cluster", v)),
}


@dataclass(frozen=True)
class SharedConfig:
    """A parsed shared-tier address plus timeouts, key prefix, TTL and breaker tuning.

    Times are in seconds. ``ttl=None`` means keys never expire. ``breaker_failures``
    consecutive failures open the breaker for ``breaker_backoff`` seconds, doubling on each
    failed probe up to ``breaker_backoff_max``. Wall-time bounds (abandoning the
    connection when passed): ``fetch_deadline`` caps one lookup, both round trips (the
    tier lowers it to what the hit could save, see ``tier``), ``publish_deadline`` one
    publish, ``flush_deadline`` the publishes still queued at close. ``max_value_bytes``
    caps a value read or written (the server's ``proto-max-bulk-len`` lowers it).
    """

    hosts: tuple[tuple[str, int], ...]
    tls: bool = False
    cluster: bool = False
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    prefix: str = "kvstore"
    connect_timeout: float = 0.05
    command_timeout: float = 0.1
    ttl: float | None = None
    tls_ca_file: str | None = None
    breaker_failures: int = 3
    breaker_backoff: float = 0.5
    breaker_backoff_max: float = 30.0
    fetch_deadline: float = 2.0
    publish_deadline: float = 10.0
    flush_deadline: float = 5.0
    max_value_bytes: int = 512 << 20  # Redis' own string limit (proto-max-bulk-len default)
    secret: bytes | None = field(default=None, repr=False)  # signs shared values (``signing``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple((h, p) for h, p in self.hosts))
        if not self.hosts:
            raise ValueError("shared URL: no host given")
        for host, port in self.hosts:
            if not host:
                raise ValueError("shared URL: empty host name")
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"shared URL: port {port!r} is not in 1..65535")
        if len(self.hosts) > 1 and not self.cluster:
            raise ValueError("shared URL: several hosts need redis+cluster:// (or cluster=True)")
        if not isinstance(self.db, int) or self.db < 0:
            raise ValueError(f"shared URL: db {self.db!r} is not a non-negative integer")
        if self.cluster and self.db != 0:
            raise ValueError(f"shared URL: Redis Cluster has only db 0, got db {self.db}")
        if self.username and not self.password:
            raise ValueError(
                f"shared URL: a user name needs a password (in the URL or ${ENV_PASSWORD})")
        if not isinstance(self.prefix, str) or not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"shared key prefix {self.prefix!r} must be non-empty letters, "
                             "digits, '_', '.' or '-' (no braces, colons or spaces)")
        for name in ("connect_timeout", "command_timeout", "breaker_backoff",
                     "breaker_backoff_max", "fetch_deadline", "publish_deadline", "flush_deadline"):
            _positive(name, getattr(self, name))
        if self.ttl is not None:
            _positive("ttl", self.ttl)
        if self.breaker_backoff_max < self.breaker_backoff:
            raise ValueError("breaker_backoff_max must be >= breaker_backoff")
        if not isinstance(self.breaker_failures, int) or self.breaker_failures < 1:
            raise ValueError(f"breaker_failures must be an integer >= 1, "
                             f"got {self.breaker_failures!r}")
        if isinstance(self.max_value_bytes, bool) or not isinstance(self.max_value_bytes, int) \
                or self.max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be a positive integer, got {self.max_value_bytes!r}")
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode())
        if self.secret is not None and (not isinstance(self.secret, bytes) or len(self.secret) < MIN_SECRET_BYTES):
            raise ValueError(f"the shared secret must be at least {MIN_SECRET_BYTES} bytes")
        if self.tls_ca_file is not None and not self.tls:
            raise ValueError("a TLS CA file needs a rediss:// URL")

    @property
    def scheme(self) -> str:
        """``redis``, ``rediss``, ``redis+cluster`` or ``rediss+cluster``."""
        return ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")

    @property
    def host(self) -> str:
        """The first (for a cluster: the first startup) host."""
        return self.hosts[0][0]

    @property
    def port(self) -> int:
        return self.hosts[0][1]

    def redacted(self) -> str:
        """The address for logs and stats: no user name, no password, no options."""
        auth = "***@" if self.username or self.password else ""
        hosts = ",".join(f"{_bracket(h)}:{p}" for h, p in self.hosts)
        path = "" if self.cluster else f"/{self.db}"
        return f"{self.scheme}://{auth}{hosts}{path}"

    @classmethod
    def from_url(cls, url: str, *, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> SharedConfig:
        """Parse ``url``; ``overrides`` (any field, or ``cluster=True``) win over the URL.

        User and password: overrides, else the URL, else ``$KVSTORE_SHARED_USER`` /
        ``$KVSTORE_SHARED_PASSWORD`` (from ``environ``, default ``os.environ``). The fleet
        secret: the ``secret`` override, else ``$KVSTORE_SHARED_SECRET``, else the file
        ``$KVSTORE_SHARED_SECRET_FILE`` names (``read_secret``).
        """
        env = os.environ if environ is None else environ
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown SharedConfig option(s): {', '.join(sorted(unknown))}")
        values = _parse_url(url)
        if values.get("username") is None and values.get("password") is None:
            values["username"] = env.get(ENV_USER) or None
            values["password"] = env.get(ENV_PASSWORD) or None
        if "secret" not in overrides:
            values["secret"] = env.get(ENV_SECRET) or (read_secret(env[ENV_SECRET_FILE])
                                                       if env.get(ENV_SECRET_FILE) else None)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides: Any) -> SharedConfig | None:
        """The config named by ``$KVSTORE_SHARED``, or None when it is unset or empty."""
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL, "").strip()
        return cls.from_url(url, environ=env, **overrides) if url else None

    def with_options(self, **changes: Any) -> SharedConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def read_secret(path: str) -> bytes:
    """A fleet secret from a file (trailing whitespace dropped); ValueError naming the file,
    never its content, when it cannot be read or is too short."""
    from .. import files

    try:  # a file kvstore did not write: never blocks on a FIFO, regular files only
        data = files.read_foreign(Path(path), limit=1 << 16).rstrip()
    except OSError as e:
        raise ValueError(f"cannot read the shared secret file {path}: {e.strerror}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"the shared secret in {path} must be at least {MIN_SECRET_BYTES} bytes")
    return data


def _parse_url(url: str) -> dict[str, Any]:
    """URL -> SharedConfig field values.

    Error messages quote nothing taken from the URL's host, path or query: a password with
    a stray ``/``, ``?`` or missing ``@`` would land there.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError("shared URL is empty")
    url = url.strip()
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("shared URL has no scheme (expected redis://host:port)")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"shared URL: unsupported scheme {scheme!r} "
                         f"(use {', '.join(s + '://' for s in SCHEMES)})")
    tls, cluster = SCHEMES[scheme]
    if "#" in rest:
        raise ValueError("shared URL: fragments (#...) are not allowed")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    values: dict[str, Any] = {"tls": tls, "cluster": cluster}
    if at:
        user, colon, password = userinfo.partition(":")
        values["username"] = unquote(user) or None
        values["password"] = unquote(password) if colon and password else None
    if not hostlist:
        raise ValueError("shared URL: no host given")
    values["hosts"] = tuple(_parse_host(h) for h in hostlist.split(","))
    path = path.strip("/")
    if path:
        if not path.isdigit():
            raise ValueError("shared URL: the path must be a db number, e.g. /0")
        values["db"] = int(path)
    for name, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in _QUERY_OPTIONS:
            shown = repr(name) if re.fullmatch(r"[A-Za-z_]{1,40}", name) else "in the query"
            raise ValueError(f"shared URL: unknown option {shown} "
                             f"(known: {', '.join(_QUERY_OPTIONS)})")
        field_name, parse = _QUERY_OPTIONS[name]
        try:
            values[field_name] = parse(raw)
        except ValueError:
            raise ValueError(f"shared URL: bad value for option {name!r}") from None
    return values


def _parse_host(text: str) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``."""
    if text.startswith("["):
        host, close, tail = text[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise ValueError("shared URL: bad IPv6 address (expected [addr] or [addr]:port)")
        port_text = tail[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError("shared URL: empty host name")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError("shared URL: a port is not a number in 1..65535")
    return host, int(port_text)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _positive(name: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}: {text!r} is not a boolean")
