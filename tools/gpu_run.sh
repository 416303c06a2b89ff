#!/usr/bin/env bash
# One device call on the GPU machine, in phases chosen by the arguments (default: all):
#   kernels  build flash-attn from the carried sdist (.gpu/), kernel tests with it, kernel microbenchmarks
#   tests    the GPU tests and the whole suite on CUDA
#   bench    bench.py on a Qwen3-0.6B-shaped random checkpoint
# Logs and results go to $OUT (default ./out). Usage: bash tools/gpu_run.sh [kernels] [tests] [bench]
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
phases=${*:-kernels tests bench}
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
  python3 -m pytest tests/test_gpu.py -q -s -rA 2>&1 | tee "$OUT/test_gpu.log" | grep -E "bf16|enforce_eager|passed|failed|Error"
  python3 -m pytest tests -q -m "not gpu" 2>&1 | tee "$OUT/test_suite_cuda.log" | tail -5
fi

if [[ $phases == *bench* ]]; then
  python3 - <<'PY' 2>&1 | tail -1
import torch
from nanovllm.utils.tiny_model import build_tiny_qwen3
# Qwen3-0.6B's shapes, random weights
build_tiny_qwen3("/tmp/qwen3-0.6b-random", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960,
                 initializer_range=0.02, dtype=torch.bfloat16)
print("built /tmp/qwen3-0.6b-random")
PY
  for flag in "" "--enforce-eager"; do
    python3 bench.py --model /tmp/qwen3-0.6b-random --num-seqs ${NUM_SEQS:-256} --json $flag 2>&1 \
      | tee -a "$OUT/bench.log" | tail -1
  done
fi
