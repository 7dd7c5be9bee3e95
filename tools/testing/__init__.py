"""What the tests, benchmarks and the demo run on: test models built once per machine
(``model_builds``), the restored-equals-cold oracle (``oracle``), and the converter of the
SmolLM2 GGUF that ``model_builds`` calls (``gguf_convert``)."""
