#!/usr/bin/env bash
# GPU check of the paged attention kernels, for a CUDA machine (sized for one H200), under 5 minutes in all:
#   1. the Triton kernels against the reference in bf16 (and fp32 against dense attention), including a 2^20 + 8-block
#      cache addressed near block 2^20 and a 128k-token context (tests/kernels/cuda_cases.py);
#   2. benchmarks/attention_kernel.py (decode time, bandwidth, fraction of copy bandwidth, vs contiguous SDPA, and a
#      sweep of decode launch configurations) -> benchmarks/results/attention_kernel_cuda.json;
#   3. a short greedy generate through the Engine with the Triton backend (and the reference backend beside it);
#   4. with more than one GPU: benchmarks/tensor_parallel.py over NCCL (TP 1, 2 and up to 8).
# Run from anywhere: bash benchmarks/gpu_check.sh [STEP ...], STEP one of kernels, bench, generate, tp (default: all).
# Every step runs even if an earlier one fails; the exit status is the number of failed steps. PY names the Python
# (default .venv/bin/python). When $OUT is set (the device runner's output folder), the JSON and a log go there too.
# The benchmark saves its JSON after every shape, so a step cut short by its limit keeps what it measured; Triton's
# compile cache (~/.triton/cache) makes a second run of this script faster than the first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOG=$(mktemp /tmp/gpu_check.XXXXXX.log)
failed=0
STEPS=" ${*:-kernels bench generate tp} "
wanted() { [[ "$STEPS" == *" $1 "* ]]; }
step() {  # step <seconds> <name> <command...>
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    local t0=$SECONDS
    if timeout "$limit" "$@" 2>&1 | tee -a "$LOG"; then
        echo "== $name: ok in $((SECONDS - t0))s" | tee -a "$LOG"
    else
        echo "== $name: FAILED after $((SECONDS - t0))s" | tee -a "$LOG"
        failed=$((failed + 1))
    fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$LOG"

wanted kernels && step 110 "kernels vs reference on CUDA" "$PY" -m pytest -q -p no:cacheprovider tests/kernels/cuda_cases.py

wanted bench && step 130 "attention benchmark" "$PY" -m benchmarks.attention_kernel --device cuda --sweep --out benchmarks/results/attention_kernel_cuda.json

wanted generate && step 150 "generate with --attention-backend triton" "$PY" -c '
import time
from runtime.engine import Engine
from runtime.sampling_params import SamplingParams

params = SamplingParams(max_tokens=24, temperature=0.0)
prompts = ["Hello", "The capital of France is"]
ids = {}
for backend in ("triton", "reference"):
    t0 = time.perf_counter()
    engine = Engine(model="smollm2", device="cuda", dtype="bfloat16", attention_backend=backend, num_blocks=2048)
    outs = engine.generate(prompts=prompts, sampling_params=params)
    ids[backend] = [o.token_ids for o in outs]
    print(backend, f"{time.perf_counter() - t0:.1f}s", [o.text for o in outs])
    del engine
same = sum(a == b for a, b in zip(ids["triton"], ids["reference"]))
print(f"greedy token ids identical for {same}/{len(prompts)} prompts (bf16: a near-tie may legitimately flip)")
assert all(len(t) > 0 for t in ids["triton"])
'

# 4. tensor parallelism over NCCL, only where more than one GPU is present: TP 1 / 2 (/ 4 / 8 as GPUs allow) of a
#    random 4-layer Llama at 4096 wide in bf16 (benchmarks/tensor_parallel.py; prefill / decode tok/s and the per-step
#    all-reduce, all-gather and relay bytes and ms) -> benchmarks/results/tensor_parallel_gpu.json
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if ! wanted tp; then
    :
elif [ "$GPUS" -gt 1 ]; then
    SIZES="1 2"
    [ "$GPUS" -ge 4 ] && SIZES="$SIZES 4"
    [ "$GPUS" -ge 8 ] && SIZES="$SIZES 8"
    step 240 "tensor parallel TP $SIZES over NCCL" "$PY" -m benchmarks.tensor_parallel --device cuda --dtype bfloat16 \
        --tp $SIZES --hidden 4096 --layers 4 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 32000 \
        --batch 1 32 --context 512 --decode-steps 32 --out benchmarks/results/tensor_parallel_gpu.json
else
    echo "== tensor parallel: skipped ($GPUS GPU present; needs 2 or more)" | tee -a "$LOG"
fi

if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/tensor_parallel_gpu.json "$OUT/" 2>/dev/null
    cp benchmarks/results/attention_kernel_cuda.json "$OUT/" 2>/dev/null
    cp "$LOG" "$OUT/gpu_check.log"
fi
echo "gpu_check: $failed failed step(s); log $LOG"
exit "$failed"
