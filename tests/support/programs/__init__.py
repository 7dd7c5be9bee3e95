"""Programs tests run in child processes: ``python -m tests.support.programs.<name> JSON``."""
