"""Unit tests: one file per MLX-free kvstore module, named after it (kvstore.shared.config ->
test_shared_config.py); no model, no child process, no server; the whole tier runs in seconds."""
