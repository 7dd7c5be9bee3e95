"""Engine adapters: how mlx-lm's server, vllm-mlx, exo and custom loops use a KVStore."""
