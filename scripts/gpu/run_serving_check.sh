#!/usr/bin/env bash
# Serves Baton on a CUDA GPU end to end (all processes, FlashInfer attention, bf16) and benchmarks
# it over HTTP, from the repository root:
#
#     bash scripts/gpu/run_serving_check.sh [SHAPE ...]   # default: qwen2.5-0.5b tiny
#
# For each random-weight shape of baton/bench/shapes.py: `baton launch --device cuda`, one chat
# completion, one over-long prompt (which must get an OpenAI error and leave the server up), then
# `baton.bench.serving` at 32 concurrent and single stream. Packages the machine lacks come as
# wheels in .whl/ (as for run_cuda_checks.sh; the serving ones too: pyzmq, fastapi, starlette,
# pydantic, pydantic_core, annotated_types, typing_inspection, uvicorn, httptools). Output goes to
# $OUT (default build/gpu-serving): per shape the server log and the benchmark JSONs.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1

OUT=${OUT:-$PWD/build/gpu-serving}
mkdir -p "$OUT"
SHAPES=("$@")
((${#SHAPES[@]})) || SHAPES=(qwen2.5-0.5b tiny)
PORT=8000
export PYTHONUNBUFFERED=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# Both shapes have head_dim 64: build FlashInfer's bf16 hd64 modules while the weights are written.
MAX_JOBS=16 python3 scripts/gpu/flashinfer_warmup.py bfloat16 64 >"$OUT/flashinfer_build.log" 2>&1 &
WARMUP=$!
for shape in "${SHAPES[@]}"; do
    python3 -c "import sys; from pathlib import Path; from baton.bench.shapes import materialize_shape
print(materialize_shape(sys.argv[1], Path('/tmp/shapes'), 'bfloat16'))" "$shape" || exit 1
done
wait "$WARMUP"
grep -E "built in|failed" "$OUT/flashinfer_build.log" | cut -c1-300

bench() {  # shape tag concurrency prompts
    timeout 150 python3 -m baton.bench.serving --base-url "http://127.0.0.1:$PORT" \
        --num-prompts "$4" --random-input-len 128 --random-output-len 128 --max-concurrency "$3" \
        --num-warmups 2 --disable-tqdm --output-json "$OUT/$1-$2.json" 2>&1 | tail -n 30
}

for shape in "${SHAPES[@]}"; do
    model=$(ls -d /tmp/shapes/"$shape"-bfloat16-*)
    echo "=== $shape ($(date +%T), ${SECONDS}s)"
    python3 -c "from baton.cli import main; raise SystemExit(main())" launch --model "$model" \
        --device cuda --dtype bfloat16 --attention-backend flashinfer --port "$PORT" \
        --max-model-len 1024 >"$OUT/$shape-server.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        kill -0 "$SERVER" 2>/dev/null || break
        sleep 1
    done
    echo "--- chat completion"
    curl -s -m 60 "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}'
    echo
    echo "--- over-long prompt (must be a 400 with an OpenAI error)"
    python3 -c "import json; print(json.dumps({'prompt': 'x ' * 3000, 'max_tokens': 4}))" \
        >/tmp/long.json
    curl -s -m 60 -w ' HTTP %{http_code}\n' "http://127.0.0.1:$PORT/v1/completions" \
        -H 'Content-Type: application/json' -d @/tmp/long.json | cut -c1-400
    echo "--- 32 concurrent"
    bench "$shape" c32 32 128
    echo "--- single stream"
    bench "$shape" c1 1 8
    kill -INT "$SERVER"
    wait "$SERVER"
    echo "server exit code $? ($(date +%T), ${SECONDS}s)"
    grep -E -i "error|traceback|exception" "$OUT/$shape-server.log" | head -n 20
    tail -n 5 "$OUT/$shape-server.log"
done
