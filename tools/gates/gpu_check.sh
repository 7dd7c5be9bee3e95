#!/usr/bin/env bash
# The GPU check of issue 55 (item 2): the device tier and the parity tests on MLX's CUDA
# backend, on the NVIDIA H200 machine this work can sometimes use (Python 3.12 with PyTorch
# for CUDA 13 and its nvidia-* libraries, numpy, safetensors, transformers, pytest,
# hypothesis; no package registry; at most 64 MiB reaches it per call).
#
# MLX's CUDA backend is the mlx-cuda-13 wheel (0.32.4: 86 MiB), over the limit of one call,
# so it travels in two parts, in two calls made one right after the other (the machine stays
# warm 30 s after a call; what a call leaves under /tmp stays while it is warm):
#
#   here, once (needs pip and the package index):
#       tools/gates/gpu_check.sh stage             # .gpu/a (part 1), .gpu/b (part 2 + the other wheels)
#   on the device machine (the session's `run` tool), back to back:
#       run(carry=[".gpu/a"], command="tools/gates/gpu_check.sh receive", timeout_s=120)
#       run(carry=[".gpu/b"], command="tools/gates/gpu_check.sh run", timeout_s=600)
#
# `run` reassembles and checks the wheel, installs MLX, mlx-lm, lmdb, platformdirs and
# google-re2 (the packages the machine lacks) into /tmp/kvstore-gpu/site with the machine's
# own nvidia-* libraries, checks MLX sees the GPU, then runs `pytest -m device` and the
# parity tests of tests/system/test_store.py (the default device there is the GPU), the
# whole log in $OUT/gpu_check.log. It stops each pytest at a time limit, inside 10 minutes
# together, so a second try fits a 15-minute allowance. A `run` that finds no part 1 (the
# machine went back between the calls) says so: make both calls again.
set -euo pipefail
cd "$(dirname "$0")/../.."

MLX=0.32.4
MLX_LM=${KVSTORE_MLX_LM:-0.32.2}
PART=52m # part 1's size: it travels with the working tree (~5 MiB), under 64 MiB in all
REMOTE=/tmp/kvstore-gpu
WHEEL=mlx_cuda_13-$MLX-py3-none-manylinux_2_35_x86_64.whl

stage() {
    git check-ignore -q .gpu/a || { echo "gpu_check: .gpu/ must be ignored (.gitignore)" >&2; exit 2; }
    rm -rf .gpu && mkdir -p .gpu/dl .gpu/a .gpu/b
    local plat=(--only-binary=:all: --python-version 3.12 --implementation cp
                --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
                --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    python3 -m pip download -q --no-deps "${plat[@]}" -d .gpu/dl \
        "mlx-cuda-13==$MLX" "mlx==$MLX" "mlx-lm==$MLX_LM" lmdb platformdirs google-re2
    (cd .gpu/dl && sha256sum "$WHEEL" >../b/"$WHEEL".sha256 && split -b "$PART" -d "$WHEEL" ../part.)
    mv .gpu/part.00 .gpu/a/
    mv .gpu/part.* .gpu/b/
    find .gpu/dl -name '*.whl' ! -name "$WHEEL" -exec mv {} .gpu/b/ \;
    rm -rf .gpu/dl
    du -sh .gpu/a .gpu/b
    ls .gpu/a .gpu/b
}

receive() {
    [ -f .gpu/a/part.00 ] || { echo "gpu_check: .gpu/a/part.00 did not arrive: carry .gpu/a" >&2; exit 2; }
    rm -rf "$REMOTE" && mkdir -p "$REMOTE/parts"
    cp .gpu/a/part.00 "$REMOTE/parts/"
    ls -la "$REMOTE/parts"
}

install() {
    [ -f "$REMOTE/parts/part.00" ] || {
        echo "gpu_check: part 1 is not on this machine (it went back after 'receive'): run 'receive' and 'run' again, back to back" >&2
        exit 3
    }
    cp .gpu/b/part.* "$REMOTE/parts/"
    mkdir -p "$REMOTE/wheels"
    cat "$REMOTE"/parts/part.* >"$REMOTE/wheels/$WHEEL"
    (cd "$REMOTE/wheels" && sha256sum -c "$OLDPWD/.gpu/b/$WHEEL.sha256")
    cp .gpu/b/*.whl "$REMOTE/wheels/"
    rm -rf "$REMOTE/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$REMOTE/site" \
        "$REMOTE"/wheels/*.whl
    # libmlx.so finds CUDA's libraries at $ORIGIN/../../nvidia/...: the machine's own, PyTorch's
    local nv
    nv=$(python3 -c 'import nvidia, os; print(os.path.realpath(list(nvidia.__path__)[0]))')
    ln -sfn "$nv" "$REMOTE/site/nvidia"
    LD_LIBRARY_PATH=$(find "$nv" -maxdepth 3 -type d -name lib | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LD_LIBRARY_PATH
}

run() {
    local out=${OUT:-/tmp}
    set -o pipefail
    checks "$out" 2>&1 | tee "$out/gpu_check.log"
}

checks() {
    local out=$1
    export PYTHONUNBUFFERED=1
    date -u
    install
    export PYTHONPATH=$REMOTE/site:$PWD
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
    python3 - <<'EOF'
import mlx.core as mx, mlx_lm, kvstore
print("mlx", mx.__version__, "mlx_lm", mlx_lm.__version__, "kvstore", kvstore.__file__)
assert mx.is_available(mx.gpu), "MLX sees no GPU"
print("default device", mx.default_device(), mx.device_info(mx.gpu))
a = mx.ones((1024, 1024)) @ mx.ones((1024, 1024)); mx.eval(a); assert a[0, 0].item() == 1024
from kvstore import pressure
print("device reading", pressure.device_read())
EOF
    local rc=0
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m device tests/system/test_device_tier.py \
        --junitxml="$out/device_tier.xml" || rc=$?
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/system/test_store.py \
        -k "restore_from_memory_equals_cold or restore_from_disk_in_new_process_equals_cold" \
        --junitxml="$out/parity.xml" || rc=$((rc ? rc : $?))
    date -u
    echo "gpu_check: rc=$rc"
    return $rc
}

case "${1:-}" in
    stage) stage ;;
    receive) receive ;;
    run) run ;;
    *) sed -n '2,26p' "$0"; exit 64 ;;
esac
