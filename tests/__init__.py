"""kvstore's tests: tests/unit (MLX-free modules, seconds) and tests/system (models, processes,
servers); fixtures and the slow marker in tests/conftest.py, helpers in tests/support."""
