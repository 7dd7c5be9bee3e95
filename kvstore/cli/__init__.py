"""The ``kvstore`` command line: ls, stats, inspect, verify, gc, warm, pin/unpin (and
serve, when installed). ``python -m kvstore.cli`` runs it too."""

from .main import main

__all__ = ["main"]
