#!/usr/bin/env bash
# One device call on the GPU machine, in phases chosen by the arguments (default: all):
#   kernels  build flash-attn from the carried sdist (.gpu/; tools/flash_attn_build.py says how to fetch it),
#            kernel tests with it, kernel microbenchmarks
#   tests    the GPU tests and the whole suite on CUDA
#   bench    bench.py (Qwen3-0.6B preset, random weights): Triton and flash-attn, graphs on and off, a profiled
#            run, the llama-3.2-1b preset
#   hf       bench.py --engine hf: the same workload through transformers (~4 min)
#   profile  tools/profile_step.py: where a decode step's time goes at batch 1/64/256/512
# Logs and results go to $OUT (default ./out). Usage: bash tools/gpu_run.sh [kernels] [tests] [bench] [hf] [profile]
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
phases=${*:-kernels tests bench profile}  # each call must stay under 10 minutes: pick
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u;
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"; } | tee "$OUT/env.txt"

if [[ $phases == *kernels* ]]; then
  python3 - <<'PY' 2>&1 | tee "$OUT/test_kernels.log" | grep -E "built|passed|failed|Error" | tail -5
import sys, time
sys.path.insert(0, "tools")
from flash_attn_build import load_flash_attn
t = time.time(); load_flash_attn(); print(f"built flash-attn in {time.time() - t:.0f} s")
import pytest
sys.exit(pytest.main(["tests/test_kernels.py", "-q", "-rA"]))
PY
  python3 tools/bench_kernels.py --out "$OUT" ${SWEEP:+--sweep} 2>"$OUT/bench_kernels.err" | tee "$OUT/bench_kernels.log" | tail -30
fi

if [[ $phases == *tests* ]]; then
  python3 tools/with_flash_attn.py -m pytest tests/test_gpu.py -q -s -rA 2>&1 | tee "$OUT/test_gpu.log" \
    | grep -E "^bf16|enforce_eager|passed|failed|Error" | cut -c1-200
  python3 -m pytest tests -q -m "not gpu" 2>&1 | tee "$OUT/test_suite_cuda.log" | tail -3
fi

if [[ $phases == *bench* ]]; then
  # the default model is the qwen3-0.6b preset with random weights; every line is one JSON result
  for flags in "" "--enforce-eager"; do
    python3 bench.py --json $flags 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
    python3 tools/with_flash_attn.py bench.py --attention-backend flash-attn --json $flags 2>>"$OUT/bench.err" \
      | tee -a "$OUT/bench.jsonl"
  done
  python3 bench.py --json --profile 2>>"$OUT/bench.err" | tee "$OUT/bench_profile.jsonl"
  python3 bench.py --model llama-3.2-1b --json 2>>"$OUT/bench.err" | tee "$OUT/bench_llama.jsonl"
  python3 tools/plot_bench.py "$OUT/bench.jsonl" "$OUT/bench.png"
fi

if [[ $phases == *hf* ]]; then  # the same workload through transformers' continuous batching (~4 min)
  python3 bench.py --engine hf --json 2>>"$OUT/bench.err" | tee "$OUT/bench_hf.jsonl"
fi

if [[ $phases == *profile* ]]; then  # per decode step: CPU time of each phase, GPU time of the forward
  python3 tools/profile_step.py 2>>"$OUT/profile.err" | tee "$OUT/profile_step.jsonl"
fi
