"""Checks besides kvstore's own tests: mlx-lm's and vllm-mlx's published test suites run
against kvstore (``upstream_mlx_lm``, ``upstream_vllm_mlx``; ``compat_env.sh`` builds the
vllm-mlx venv), the import rules of kvstore, tools and benchmarks (``layers``), and the
module -> tests table of docs/design.md (``testmap``)."""
