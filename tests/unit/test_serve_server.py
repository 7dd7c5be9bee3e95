"""kvstore.serve.server: the ``kvstore serve`` flags read into their configurations."""

from __future__ import annotations


def test_serve_shared_flags():
    import argparse

    from kvstore.serve.server import setup_arg_parser, shared_config

    p = argparse.ArgumentParser()
    setup_arg_parser(p)
    ours, rest = p.parse_known_args(["--shared", "rediss://u:pw@h:7000/1", "--shared-prefix", "team",
                                     "--shared-ttl", "600", "--shared-timeout", "250", "--model", "m"])
    c = shared_config(ours)
    assert (c.tls, c.db, c.prefix, c.ttl, c.command_timeout) == (True, 1, "team", 600.0, 0.25)
    assert rest == ["--model", "m"] and shared_config(p.parse_known_args([])[0]) is None
