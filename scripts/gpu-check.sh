#!/usr/bin/env bash
# The GPU check, on one CUDA GPU, in under 8 minutes: install the carried wheels, run the CUDA tests, run a short
# throughput benchmark, and write everything under $OUT (the device tool's result folder; ./gpu-check-out elsewhere).
#
#   bash scripts/fetch-gpu-wheels.sh       # here, once: the wheels the GPU machine lacks, into .whl/
#   bash scripts/gpu-check.sh              # there, with .whl carried
#
# Results (at most 8 files, the device tool's limit): env.txt (GPU, driver, versions), cuda-tests.log and
# cuda-tests.xml (pytest), bench.jsonl (one row per benchmark level), bench.log, RESULTS-gpu.md (the figures, for
# bench/RESULTS-gpu.md) and summary.txt. Each benchmark part runs in its own process under a timeout taken from
# what is left of the budget, the most telling first, so a hang or crash costs one column, not the run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_SECONDS:-450}  # the whole script; the benchmark gets what the tests leave
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SECONDS=0

# 1. Wheels carried in .whl/ (scripts/gpu-wheels.txt): installed beside the image's packages, not over them.
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed" | tee "$OUT/summary.txt"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    echo "no .whl/ folder: assuming the FastAPI stack, xgrammar and gguf are installed" >&2
    export PYTHONPATH=$PWD
fi

# 2. The machine, for the record.
{
    date -u '+%Y-%m-%d %H:%M UTC'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PY" - <<'PY'
import importlib.util, sys
import torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, transformers {transformers.__version__}")
print("cuda available:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("flash-attn installed:", importlib.util.find_spec("flash_attn") is not None)
PY
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 3. The CUDA tests: the Triton kernel against torch SDPA and float64; the decoder against transformers on CUDA for
# every family and the embedded model's shape; CUDA graphs against eager; flash-attn where installed.
timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" \
    tests/model/test_triton_attention.py tests/model/test_cuda_parity.py \
    tests/engine/test_cuda_graphs.py tests/engine/test_flash_attention.py >"$OUT/cuda-tests.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT/cuda-tests.log"

# 4. Throughput at 1, 16, 64 and 256 streams, ours with CUDA graphs and without, then transformers'.
: >"$OUT/bench.jsonl"
for part in llama-1b:llmserve llama-1b:llmserve-eager llama-1b:hf-generate smollm2:llmserve smollm2:llmserve-eager \
    smollm2:hf-generate llama-1b:hf-cb smollm2:hf-cb; do
    left=$((BUDGET - SECONDS - 15))  # 15 s kept for the report
    if [ "$left" -lt 20 ]; then
        echo "$part: skipped, out of time" | tee -a "$OUT/bench.log"
        continue
    fi
    limit=$((left < 90 ? left : 90))
    echo "== $part (limit ${limit}s, ${SECONDS}s elapsed)" >>"$OUT/bench.log"
    timeout "$limit" "$PY" bench/gpu_throughput.py run --model "${part%%:*}" --backend "${part##*:}" \
        --jsonl "$OUT/bench.jsonl" >>"$OUT/bench.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || echo "$part: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out)')" | tee -a "$OUT/bench.log"
done
"$PY" bench/gpu_throughput.py report --jsonl "$OUT/bench.jsonl" --out "$OUT/RESULTS-gpu.md"
cat "$OUT/RESULTS-gpu.md"

{
    echo "tests: exit $tests_rc; $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/cuda-tests.log" | tail -n 1)"
    echo "benchmark rows: $(wc -l <"$OUT/bench.jsonl")"
    echo "elapsed: ${SECONDS}s"
} | tee "$OUT/summary.txt"
exit "$tests_rc"
