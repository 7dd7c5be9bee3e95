"""Engine adapters: how mlx-lm's server, vllm-mlx and custom loops use a KVStore."""
