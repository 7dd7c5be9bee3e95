"""kvstore.shared.config: shared-tier URLs, credentials and options; secrets never shown."""

from __future__ import annotations

import pytest

from kvstore.shared import SharedClient, SharedConfig
from kvstore.shared.client import client_kwargs

SECRET = "hunter2-Zq9"


def test_url_forms_and_overrides() -> None:
    c = SharedConfig.from_url("redis://alice:p%40ss@cache.example:7000/3?prefix=team-a&ttl=60",
                              environ={})
    assert (c.hosts, c.db, c.username, c.password, c.prefix, c.ttl) == (
        (("cache.example", 7000),), 3, "alice", "p@ss", "team-a", 60.0)
    assert (c.tls, c.cluster, c.scheme) == (False, False, "redis")
    assert (c.connect_timeout, c.command_timeout) == (0.05, 0.1)

    t = SharedConfig.from_url("rediss://h?ca_file=/etc/ca.pem", environ={},
                              command_timeout=0.3)
    assert (t.tls, t.port, t.tls_ca_file, t.command_timeout) == (True, 6379, "/etc/ca.pem", 0.3)
    assert client_kwargs(t)["ssl"] is True and client_kwargs(t)["ssl_ca_certs"] == "/etc/ca.pem"

    cl = SharedConfig.from_url("rediss+cluster://n1:7000,[::1]:7001,n3", environ={})
    assert cl.cluster and cl.tls and cl.hosts == (("n1", 7000), ("::1", 7001), ("n3", 6379))
    assert SharedConfig.from_url("redis://n1:7000", cluster=True, environ={}).scheme == \
        "redis+cluster"
    assert SharedConfig.from_url("redis://n1?cluster=yes", environ={}).cluster


def test_credentials_from_env_and_precedence() -> None:
    env = {"KVSTORE_SHARED_USER": "envuser", "KVSTORE_SHARED_PASSWORD": "envpw",
           "KVSTORE_SHARED": "redis://h:1/2"}
    from_env = SharedConfig.from_env(env)
    assert from_env is not None
    assert (from_env.username, from_env.password, from_env.db) == ("envuser", "envpw", 2)
    url_wins = SharedConfig.from_url("redis://u:p@h", environ=env)
    assert (url_wins.username, url_wins.password) == ("u", "p")
    override_wins = SharedConfig.from_url("redis://u:p@h", environ=env, password="o")
    assert override_wins.password == "o"
    assert SharedConfig.from_env({}) is None


@pytest.mark.parametrize("url, problem", [
    ("", "empty"),
    ("cache.example:6379", "no scheme"),
    ("http://h", "unsupported scheme 'http'"),
    ("redis://", "no host"),
    (f"redis://u:{SECRET}@h:99999", "port"),
    (f"redis://u:{SECRET}h:6379", "port"),  # the '@' forgotten: the password parses as a port
    (f"redis://u:ab/{SECRET}@h/0", "port"),  # an unencoded '/' in the password
    (f"redis://u:ab?{SECRET}@h", "port"),  # an unencoded '?'
    (f"redis://h?{SECRET}@x=1", "unknown option in the query"),
    ("redis://h/x", "db number"),
    ("redis://h?colour=blue", "unknown option 'colour'"),
    ("redis://h?ttl=soon", "bad value for option 'ttl'"),
    ("redis://h?ttl=-5", "ttl must be a positive"),
    ("redis://h1,h2", "redis+cluster"),
    ("redis+cluster://h/2", "only db 0"),
    ("redis://someone@h", "needs a password"),
    ("redis://h?prefix=a{b}", "prefix"),
    ("redis://h?connect_timeout=0", "connect_timeout must be a positive"),
    ("redis://h?ca_file=/x", "rediss://"),
])
def test_bad_urls_name_the_problem_and_hide_secrets(url: str, problem: str) -> None:
    with pytest.raises(ValueError) as err:
        SharedConfig.from_url(url, environ={})
    assert problem in str(err.value)
    assert SECRET not in str(err.value)


def test_redacted_repr_and_unknown_options() -> None:
    c = SharedConfig.from_url(f"redis://alice:{SECRET}@h:1/4", environ={})
    assert c.redacted() == "redis://***@h:1/4"
    assert SECRET not in repr(c) and "alice" not in repr(c)
    assert SECRET not in repr(SharedClient(c))
    with pytest.raises(ValueError, match="unknown SharedConfig option"):
        SharedConfig.from_url("redis://h", environ={}, timeout=1)
