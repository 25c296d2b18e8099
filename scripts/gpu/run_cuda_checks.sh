#!/usr/bin/env bash
# Runs Baton's CUDA tests (tests/cuda, marker `cuda`) on a machine with an NVIDIA GPU, from the
# repository root:
#
#     bash scripts/gpu/run_cuda_checks.sh
#
# Python packages the machine lacks can come as wheels in .whl/ (pip download --no-deps, for its
# Python and platform): they are installed into /tmp/site first. Output goes to $OUT (default
# build/cuda-checks): env.txt (machine and versions), pytest.log, metrics.txt (each test's
# numbers), flashinfer_build.log.
#
# FlashInfer compiles its kernels with nvcc on first use, minutes per dtype and head_dim. So the
# engine and torch-backend tests run first while scripts/gpu/flashinfer_warmup.py builds the
# FlashInfer modules in the background (one process per dtype and head_dim, later ones at lower
# priority); each dtype/head_dim's FlashInfer tests run once its modules are built. Everything
# stops after CUDA_CHECKS_SECONDS (default 330) so that the logs come back from a time-limited
# run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

OUT=${OUT:-$PWD/build/cuda-checks}
mkdir -p "$OUT"
BUDGET=${CUDA_CHECKS_SECONDS:-330}
export PYTHONUNBUFFERED=1
# tvm-ffi (FlashInfer's FFI) would otherwise JIT-compile an optional torch DLPack addon at import.
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
export BATON_CUDA_METRICS=$OUT/metrics.txt
: >"$BATON_CUDA_METRICS"
LOG=$OUT/pytest.log
: >"$LOG"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -n 2
    python3 - <<'EOF'
import sys

import torch
import transformers

print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("transformers", transformers.__version__)
try:
    import flashinfer

    print("flashinfer", flashinfer.__version__)
except Exception as error:
    print("flashinfer unavailable:", type(error).__name__, error)
EOF
} 2>&1 | tee "$OUT/env.txt"

remaining() {  # seconds left, at least 1 (timeout 0 would mean none)
    local left=$((BUDGET - SECONDS))
    echo $((left > 0 ? left : 1))
}
PYTEST=(python3 -m pytest -q -x -m cuda tests/cuda -p no:cacheprovider -rfEsxX)

# FlashInfer kernels, most wanted first: "dtype head_dim set -k-expression" (set "gemma":
# Gemma 2's soft-capped, windowed kernels, flashinfer_warmup.py --gemma).
KERNELS=("bfloat16 128 plain bf16 and hd128 and not gemma" "bfloat16 128 gemma gemma and bf16 and hd128"
    "float16 64 plain fp16 and hd64" "bfloat16 64 plain bf16 and hd64" "float16 128 plain fp16 and hd128")
JOBS=(10 4 3 3 3)  # ninja jobs per build; nvcc of the Hopper kernels takes GBs each
WARMUP_PIDS=()
DONE_DIR=/tmp/flashinfer-warmup/done
rm -rf "$DONE_DIR"
if python3 -c "import torch, flashinfer; assert torch.cuda.is_available()" 2>/dev/null; then
    for i in "${!KERNELS[@]}"; do
        read -r dtype head_dim set _ <<<"${KERNELS[$i]}"
        extra=()
        [[ $set == gemma ]] && extra=(--gemma)
        MAX_JOBS=${JOBS[$i]} nice -n $((4 * i)) python3 scripts/gpu/flashinfer_warmup.py \
            "$dtype" "$head_dim" "${extra[@]}" --done "$DONE_DIR/$dtype-$head_dim-$set" \
            >>"$OUT/flashinfer_build.log" 2>&1 &
        WARMUP_PIDS+=($!)
    done
else
    echo "no CUDA device or flashinfer does not import: its tests will skip" | tee -a "$LOG"
fi

echo "=== engine and torch backend on CUDA ($(date +%T), ${SECONDS}s)" | tee -a "$LOG"
timeout "$(remaining)" "${PYTEST[@]}" -k "not flashinfer" 2>&1 | tee -a "$LOG"

if ((${#WARMUP_PIDS[@]})); then
    for entry in "${KERNELS[@]}"; do
        read -r dtype head_dim set selector <<<"$entry"
        done_file="$DONE_DIR/$dtype-$head_dim-$set"
        while [[ ! -f $done_file ]] && (($(remaining) > 20)); do sleep 2; done
        if [[ ! -f $done_file ]]; then
            echo "=== flashinfer $dtype hd$head_dim $set: kernels not built in time (${SECONDS}s)" \
                | tee -a "$LOG"
            continue
        fi
        if [[ $(cat "$done_file") != ok ]]; then
            echo "=== flashinfer $dtype hd$head_dim $set: build failed (flashinfer_build.log)" \
                | tee -a "$LOG"
            continue
        fi
        echo "=== flashinfer $dtype hd$head_dim $set ($(date +%T), ${SECONDS}s)" | tee -a "$LOG"
        timeout "$(remaining)" "${PYTEST[@]}" -k "flashinfer and $selector" 2>&1 | tee -a "$LOG"
    done
    for pid in "${WARMUP_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
fi

echo "=== metrics (${SECONDS}s)"
cat "$BATON_CUDA_METRICS"
echo "=== flashinfer build"
grep -E "modules:|installed|built in|failed" "$OUT/flashinfer_build.log" 2>/dev/null | cut -c1-300
