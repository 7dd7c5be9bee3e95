"""Test support code as real modules: prompts, models, stores, servers, Redis servers, and the
programs tests run in child processes (``tests/support/programs``).

pytest puts the repo root on ``sys.path`` (``pythonpath`` in pyproject.toml), so tests import
these as ``tests.support.<module>``; child processes get the root through
``tests.support.children.child_env``.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
