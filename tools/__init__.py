"""Tools around kvstore, one sub-package per kind:

- ``demo.py``: README's first command (``python tools/demo.py``).
- ``testing/``: what the tests, benchmarks and the demo run on: the test models
  (``model_builds``), the restored-equals-cold oracle (``oracle``), the SmolLM2 GGUF
  converter (``gguf_convert``).
- ``gates/``: checks CI runs besides the tests: peers' own test suites against kvstore
  (``upstream_mlx_lm``, ``upstream_vllm_mlx``, ``compat_env.sh``) and the import rules
  (``layers``).
- ``harness/``: long runs with committed results beside them (``faults/``, ``families/``,
  each with a ``results/`` folder).
"""
