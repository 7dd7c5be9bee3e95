"""Engine adapters: how mlx-lm's prompt cache, vllm-mlx, exo and custom loops use a KVStore
(``kvstore serve``, the server built on mlx_lm.server, is ``kvstore.serve``)."""
