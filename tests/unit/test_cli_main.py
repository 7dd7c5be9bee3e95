"""kvstore.cli.main: the commands' errors about the shared tier are clear."""

from __future__ import annotations


def test_cli_shared_errors_are_clear(capsys):
    from kvstore.cli.main import main

    assert main(["stats", "--shared", "redis://127.0.0.1:1/0"]) == 1
    assert "does not answer" in capsys.readouterr().err
    assert main(["gc", "--shared", "redis://127.0.0.1:1/0"]) == 2
    assert "--identity" in capsys.readouterr().err
