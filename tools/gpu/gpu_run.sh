#!/usr/bin/env bash
# GPU tests and measurements of this repository on an NVIDIA Hopper GPU (H100 or H200, sm_90): the phases named
# in the arguments, in that order, each step's output appended to a log in the output directory.
#
#   bash tools/gpu/gpu_run.sh [-o DIR] PHASE...
#   BASELINE=/path/to/other/checkout bash tools/gpu/gpu_run.sh compare
#
# Needs: a CUDA build of torch and this repository's dependencies (`pip install -e ".[test,structured]"`). It runs
# its steps in the repository root, wherever it is started. Settings, as environment variables:
#   OUT         the output directory (default ./gpu-results, relative to where the script is started; -o DIR sets it
#               too): env.txt (GPU, driver, versions, commits), one log or JSON-lines file per kind of step with its
#               stderr in the same name plus .err, skipped.txt (steps skipped, cut or failed)
#   CACHE       downloads and generated inputs (default .gpu in the repository root, which git ignores): the
#               flash-attn 2.8.3 sdist (flash_attn-2.8.3.tar.gz, or FLASH_ATTN_SDIST; tools/gpu/flash_attn_build.py
#               says how to fetch it), optionally wheels/ (xgrammar and its dependencies, installed from there when
#               there), and bench-structured/ (the tokenizer tools/bench_structured.py trains once)
#   BASELINE    another checkout of this repository, for compare, ab and the *_before phases: each tree runs its
#               own bench.py and tools
#   TIME_LIMIT  seconds for the whole invocation (default: none); a step that would overrun it is cut (its log
#               kept) and a step with under 20 s left is skipped, both noted in skipped.txt
#   PYTHON      the interpreter (default python3)
# Phases (the case statement below has each command):
#   compare   bench.py --json and (where both trees have it) tools/bench_structured.py --json, in BASELINE and in
#             this tree, alternating: baseline, current, baseline, current (COMPARE_REPS pairs, default 2); the
#             results in compare-{bench,structured}-{baseline,current}.jsonl, a summary of tok/s per tree at the end
#   ab        the same for bench.py alone (AB_REPS pairs, default 2): bench_before.jsonl (BASELINE), bench.jsonl
#   scenarios_ab bench.py's scenarios (SCENARIOS) in BASELINE, then in this tree
#   bench_before / profile_before / startup_before: BASELINE's bench.py / tools/profile_step.py /
#             tools/startup_time.py
#   kernels   the kernel tests with flash-attn (phases with flash-attn use the installed one, else build it from the
#             sdist), then the kernel microbenchmarks (SWEEP=1: with a tile sweep)
#   ktests    the kernel tests alone (no flash-attn build); ktests_dense: the dense-layer kernel tests alone
#   linear    the dense-layer kernel tests, then the linear-layer microbenchmarks against cuBLAS with a tile sweep
#   gputests  tests/test_gpu.py on one GPU with flash-attn (no TP tests); asynctest: its async-against-sync and
#             float32 tests
#   allgpu    every test marked gpu, on one GPU without flash-attn (no TP tests)
#   gpu1      tests/test_gpu.py on one GPU without flash-attn (no TP tests; GPU_TESTS: a -k expression); gpu1v: the
#             same, each test's result printed as it ends
#   onegpu    one GPU, no flash-attn: the GPU tests of test_gpu.py and test_reliability.py, then the engine, sampling
#             and API tests on CUDA
#   suite     the whole CPU suite, run on CUDA;  sampling: its sampling and API tests alone
#   reliability  the GPU tests of tests/test_reliability.py
#   bench     bench.py (Qwen3-0.6B preset, random weights) with the defaults, then with --profile;
#             benchfa / eager / sync: the default workload with flash-attn / --enforce-eager / --no-async-scheduling
#   llama     bench.py --model llama-3.2-1b;  hf: the workload through transformers (minutes)
#   scenarios bench.py --scenario batch1 / batch16 / long / prefix, and the 8B preset's default workload (SCENARIOS
#             picks the scenarios and leaves the 8B run out); scenariosfa: the same with flash-attn; scenarios256:
#             the scenarios at kvcache_block_size 256 (default batch1 batch16 long)
#   blocksizes bench.py at kvcache_block_size 16 ... 256, the default workload and BLOCK_SCENARIOS (default
#             "prefix batch16")
#   profile   tools/profile_step.py (where a decode step's time goes) at batch 1/16/64/256 for MODELS (default
#             qwen3-0.6b qwen3-8b); profile8: Qwen3-0.6B at batch 64 and 256, bf16 and fp8 cache; profile8b: the
#             8B preset
#   startup   import time of torch and nanovllm, then tools/startup_time.py (LLM(...) construction, cold and warm
#             compiler caches): the preset with random weights, then from a checkpoint of its shapes (written once
#             into CACHE/ckpt-qwen3-0.6b, about 10 s)
#   fp8wtests the fp8-weight kernels' and engine's GPU tests (dense, MoE), tools/bench_fp8.py and the fp8
#             MoE microbenchmark
#   fp8moe    the fused MoE's fp8 GPU tests and tools/bench_kernels.py --only moe (MOE_SWEEP=1: with its tile sweep)
#   cascade   tests/test_cascade.py on CUDA, then tools/bench_cascade.py (plain against cascade decode attention,
#             CASCADE_QUICK=1: fewer points, CASCADE_MODELS: 0.6b and/or 8b, CASCADE_PARTS: prefix_parts to time
#             each point with too, e.g. "1 2 4 8 16"); cascade_tests / cascade_bench: either
#             alone. Its scenarios against the code before it: BASELINE=<git archive 3af4930>
#             SCENARIOS="prefix rl default batch1 batch16 long" ... scenarios_ab
#   spec      tests/test_speculative.py on CUDA, then tools/bench_spec.py --oracle (SPEC_MODELS, default qwen3-0.6b
#             qwen3-8b; SPEC_BATCHES, default 1 4 16 64; accept 2 3 4, and n-gram), bench.py --scenario batch1-ngram
#             and batch1 (SPEC_PROFILE=1: each verify run's host profile in bench_spec.jsonl.err); spec_tests:
#             the tests alone. Measured on an H100 only (2026-12-05); on an H200:
#             SPEC_BATCHES="1 4 16 64" bash tools/gpu/gpu_run.sh spec
#   fp8skinny tools/bench_fp8.py --skinny-sweep: the skinny fp8 kernel's tiles and splits over K, each checked
#             against the engine's rule's output, beside bf16's skinny kernel (8B projections, 1 and 16 rows)
#   fp8wbench bench.py on the 8B preset (bf16, block-wise fp8, quantization=fp8), its batch1-8b scenario the same three
#             ways, the 0.6B preset with a bf16 and an fp8 cache and with quantization=fp8, and the demo model's
#             perplexity with fp8 weights
#   rl        the RL-rollout tests on CUDA, then tools/bench_rl.py on the 8B preset
#   fp8       the fp8-cache and sliding-window kernel tests, decode microbenchmarks over an fp8 cache with a tile
#             sweep, bench.py with the model's dtype and with an fp8 cache, the presets' KL divergence
#             (FP8_QUALITY=0 leaves it out);  kvquality: the KL divergence alone;  probe: tools/fp8_decode_probe.py
#   structured tools/bench_structured.py (64 JSON-schema requests against the same 64 unconstrained, Qwen3-0.6B
#             shapes, random weights) with the defaults, --no-handoff and --no-async-scheduling, then
#             tests/test_structured_output.py on CUDA;  structured2: the defaults, then with OMP_NUM_THREADS=1;
#             structured_phases: the host's milliseconds a step by phase (--phases), with the handoff and without
#   moe       tests/test_moe.py, the fused MoE kernel against a per-expert cuBLAS loop, then bench.py --model
#             qwen3-30b-a3b (~61 GB of bf16 dummy weights), default workload and --scenario batch1; moebench: the
#             two bench.py runs alone
#   train     tools/train_demo_model.py into OUT/demo, and with --include-tests into OUT/demo_tests, side by side
#   tp1       bench.py --model qwen3-8b at TP 1;  tp2 (2 GPUs): bench.py at TP 2 for both presets and the TP GPU
#             tests (tp2a: the 0.6B half, tp2b: the 8B half);  tp2tests: the TP GPU tests alone
# tools/gpu/gpu_x2.sh runs two phase lists at once, one per GPU.
set -u -o pipefail
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-results}
if [[ ${1:-} == -o || ${1:-} == --out ]]; then OUT=${2:?"-o needs a directory"}; shift 2; fi
if (($# == 0)); then sed -n '2,/^# tools\/gpu\/gpu_x2.sh/p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd) || exit 1
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
[[ -e $OUT/.gitignore ]] || echo '*' > "$OUT/.gitignore"   # results stay out of git wherever they are written
CACHE=${CACHE:-$ROOT/.gpu}; mkdir -p "$CACHE" && CACHE=$(cd "$CACHE" && pwd)
cd "$ROOT" || exit 1
export FLASH_ATTN_SDIST=${FLASH_ATTN_SDIST:-$CACHE/flash_attn-2.8.3.tar.gz}
EXTRA_PATH=""   # prepended to both trees' PYTHONPATH (xgrammar from CACHE/wheels)
export PYTHONPATH=$ROOT PYTHONUNBUFFERED=1
START=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
  "$PYTHON" -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"
  echo "tree $ROOT at $(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo "(not a git checkout)")"
  [[ -n ${BASELINE:-} ]] && echo "baseline $BASELINE at $(git -C "$BASELINE" describe --always --dirty 2>/dev/null \
    || echo "(not a git checkout)")"
} | tee -a "$OUT/env.txt"

step() {  # step LOG COMMAND...: stdout appended to OUT/LOG, stderr to OUT/LOG.err, under what is left of TIME_LIMIT
  local log=$1; shift
  local limit=()
  if [[ -n ${TIME_LIMIT:-} ]]; then
    local left=$((TIME_LIMIT - (SECONDS - START)))
    if ((left < 20)); then echo "SKIPPED (no time left): $*" | tee -a "$OUT/skipped.txt"; return 1; fi
    limit=(timeout -k 5 "$left")
  fi
  echo "== $*" >&2
  local before; before=$(cat "$OUT/$log" 2>/dev/null | wc -l)
  ${limit[@]+"${limit[@]}"} "$@" >>"$OUT/$log" 2>>"$OUT/$log.err"
  local rc=$?
  ((rc == 124)) && echo "CUT at TIME_LIMIT: $*" | tee -a "$OUT/skipped.txt"
  ((rc != 0 && rc != 124)) && echo "FAILED (exit $rc): $* (see $log.err)" | tee -a "$OUT/skipped.txt"
  tail -n +$((before + 1)) "$OUT/$log" | tail -n 3   # what this step printed last
  return $rc
}
trees() {  # IN_BASELINE / IN_CURRENT: a command's prefix that runs it in that tree, its own nanovllm first on the path
  IN_BASELINE=(env -C "${BASELINE:-.}" PYTHONPATH="$EXTRA_PATH${BASELINE:-}")
  IN_CURRENT=(env PYTHONPATH="$EXTRA_PATH$ROOT")
}
need_baseline() {
  if [[ -z ${BASELINE:-} || ! -f ${BASELINE:-}/bench.py ]]; then
    echo "phase $phase needs BASELINE=/path/to/another/checkout of this repository (with bench.py)" >&2; exit 2
  fi
  BASELINE=$(cd "$BASELINE" && pwd)
  trees
}
FA=("$PYTHON" tools/gpu/with_flash_attn.py)
structured_extra() {  # xgrammar: from CACHE/wheels when there are wheels there, else the installed one
  if compgen -G "$CACHE/wheels/*.whl" >/dev/null; then
    step pip_structured.log "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/nanovllm-structured "$CACHE"/wheels/*.whl
    EXTRA_PATH=/tmp/nanovllm-structured:
    export PYTHONPATH=$EXTRA_PATH$ROOT
    trees
  elif ! "$PYTHON" -c "import xgrammar" 2>/dev/null; then
    echo "phase $phase needs xgrammar: pip install -e '.[structured]' (or its wheels in $CACHE/wheels)" >&2; exit 2
  fi
}
kv_quality() {  # the KL divergence an fp8 cache costs the presets' logits (phases fp8, kvquality)
  for m in qwen3-0.6b qwen3-8b; do
    step kv_quality.jsonl "$PYTHON" tools/kv_quality.py --preset $m --device cuda --prompts 4 --tokens 1024 --chunk 256
  done
}
compare_summary() {  # tok/s per tree of the compare phase's result files
  "$PYTHON" - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])

def lines(name):
    path = out / name
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows

print("== compare: output tok/s per tree")
for tree in ("baseline", "current"):
    runs = [r["tok_per_s"] for r in lines(f"compare-bench-{tree}.jsonl")]
    if runs:
        print(f"bench.py         {tree:8s}  runs {', '.join(f'{t:,.1f}' for t in runs)}  mean {statistics.mean(runs):,.1f}")
    else:
        print(f"bench.py         {tree:8s}  no result (see compare-bench-{tree}.jsonl.err)")
for tree in ("baseline", "current"):
    runs = lines(f"compare-structured-{tree}.jsonl")
    for r in runs:
        m = r["median_tok_per_s"]
        print(f"bench_structured {tree:8s}  free {m['free']:,.1f}  JSON {m['json']:,.1f}  JSON/free {r['json_over_free']}")
PY
}

for phase in "$@"; do
  case $phase in
    compare)
      need_baseline
      [[ -f $BASELINE/tools/bench_structured.py && -f tools/bench_structured.py ]] && structured=1 || structured=0
      ((structured)) && structured_extra
      for i in $(seq "${COMPARE_REPS:-2}"); do
        step compare-bench-baseline.jsonl "${IN_BASELINE[@]}" "$PYTHON" bench.py --json
        ((structured)) && step compare-structured-baseline.jsonl "${IN_BASELINE[@]}" "$PYTHON" tools/bench_structured.py \
          --json --work "$CACHE/bench-structured"
        step compare-bench-current.jsonl "${IN_CURRENT[@]}" "$PYTHON" bench.py --json
        ((structured)) && step compare-structured-current.jsonl "${IN_CURRENT[@]}" "$PYTHON" tools/bench_structured.py \
          --json --work "$CACHE/bench-structured"
      done
      compare_summary | tee "$OUT/compare-summary.txt" ;;
    ab)
      need_baseline
      for i in $(seq "${AB_REPS:-2}"); do
        step bench_before.jsonl "${IN_BASELINE[@]}" "$PYTHON" bench.py --json
        step bench.jsonl "${IN_CURRENT[@]}" "$PYTHON" bench.py --json
      done ;;
    scenarios_ab)  # each of SCENARIOS (default: prefix rl default batch1 batch16 long), BASELINE's bench.py then
      need_baseline  # this tree's, AB_REPS pairs (default 1): scenarios_before.jsonl, scenarios_after.jsonl
      for s in ${SCENARIOS:-prefix rl default batch1 batch16 long}; do
        for i in $(seq "${AB_REPS:-1}"); do
          step scenarios_before.jsonl "${IN_BASELINE[@]}" "$PYTHON" bench.py --json --scenario "$s"
          step scenarios_after.jsonl "${IN_CURRENT[@]}" "$PYTHON" bench.py --json --scenario "$s"
        done
      done ;;
    bench_before) need_baseline; step bench_before.jsonl "${IN_BASELINE[@]}" "$PYTHON" bench.py --json ;;
    profile_before)
      need_baseline
      for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
        step profile_before.jsonl "${IN_BASELINE[@]}" "$PYTHON" tools/profile_step.py --model $m
      done ;;
    startup_before) need_baseline; step startup_before.jsonl "${IN_BASELINE[@]}" "$PYTHON" tools/startup_time.py ;;
    kernels)
      step test_kernels.log "${FA[@]}" -m pytest tests/test_kernels.py -q -rA
      step bench_kernels.log "$PYTHON" tools/bench_kernels.py --out "$OUT" ${SWEEP:+--sweep} ;;
    ktests) step test_kernels.log "$PYTHON" -m pytest tests/test_kernels.py -q -rA ;;
    ktests_dense) step test_kernels.log "$PYTHON" -m pytest tests/test_kernels.py -q -rA -k "skinny or rms_norm" ;;
    linear)
      step test_kernels.log "$PYTHON" -m pytest tests/test_kernels.py -q -rA -k "skinny or rms_norm"
      step bench_linear.log "$PYTHON" tools/bench_kernels.py --only linear --sweep --out "$OUT" ;;
    gputests)  # all but the TP tests and asynctest's
      step test_gpu.log "${FA[@]}" -m pytest tests/test_gpu.py -q -s -rA \
        -k "not tensor_parallel and not async_scheduling_matches and not float32" ;;
    asynctest) step test_gpu.log "$PYTHON" -m pytest tests/test_gpu.py -q -s -rA -k "async_scheduling_matches or float32" ;;
    allgpu) step test_allgpu.log "$PYTHON" -m pytest tests -q -rfE -m gpu -k "not tensor_parallel" ;;
    gpu1) step test_gpu.log "$PYTHON" -m pytest tests/test_gpu.py -q -rA -m gpu -k "${GPU_TESTS:-not tensor_parallel}" ;;
    gpu1v) step test_gpu.log "$PYTHON" -m pytest tests/test_gpu.py -v -m gpu -k "${GPU_TESTS:-not tensor_parallel}" ;;
    onegpu)  # one GPU, no flash-attn: the CUDA tests, then the engine-facing CPU tests on CUDA
      step test_gpu.log "$PYTHON" -m pytest tests/test_gpu.py tests/test_reliability.py -q -rA -m gpu \
        -k "not tensor_parallel"
      step test_cuda.log "$PYTHON" -m pytest tests/test_engine.py tests/test_sampling.py tests/test_api.py -q -rA \
        -m "not gpu" ;;
    suite) step test_suite_cuda.log "$PYTHON" -m pytest tests -q -m "not gpu" -x ;;
    sampling) step test_sampling_cuda.log "$PYTHON" -m pytest tests/test_sampling.py tests/test_api.py -q -rA ;;
    reliability) step test_reliability.log "$PYTHON" -m pytest tests/test_reliability.py -q -rA -m gpu ;;
    bench)  # Triton, CUDA Graphs, async scheduling (the defaults); then again under torch.profiler
      step bench.jsonl "$PYTHON" bench.py --json
      step bench_profile.jsonl "$PYTHON" bench.py --json --profile ;;
    benchfa) step bench.jsonl "${FA[@]}" bench.py --attention-backend flash-attn --json ;;
    eager) step bench.jsonl "$PYTHON" bench.py --json --enforce-eager ;;
    sync) step bench.jsonl "$PYTHON" bench.py --json --no-async-scheduling ;;
    llama) step bench_llama.jsonl "$PYTHON" bench.py --model llama-3.2-1b --json ;;
    hf) step bench_hf.jsonl "$PYTHON" bench.py --engine hf --json ;;
    scenarios)
      for s in ${SCENARIOS:-batch1 batch16 long prefix}; do step bench.jsonl "$PYTHON" bench.py --scenario $s --json; done
      [[ -z ${SCENARIOS:-} ]] && step bench.jsonl "$PYTHON" bench.py --model qwen3-8b --json ;;
    scenariosfa)  # flash-attn's paged cache takes blocks of 256 tokens (its default block size)
      for s in ${SCENARIOS:-batch1 batch16 long prefix}; do
        step bench.jsonl "${FA[@]}" bench.py --attention-backend flash-attn --scenario $s --json
      done
      [[ -z ${SCENARIOS:-} ]] && step bench.jsonl "${FA[@]}" bench.py --attention-backend flash-attn --model qwen3-8b --json ;;
    scenarios256)
      for s in ${SCENARIOS:-batch1 batch16 long}; do
        step bench.jsonl "$PYTHON" bench.py --block-size 256 --scenario $s --json
      done ;;
    blocksizes)
      for b in 16 32 64 128 256; do
        step bench_blocks.jsonl "$PYTHON" bench.py --block-size $b --json
        for s in ${BLOCK_SCENARIOS-prefix batch16}; do
          step bench_blocks.jsonl "$PYTHON" bench.py --block-size $b --scenario $s --json
        done
      done ;;
    profile)
      for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do step profile_step.jsonl "$PYTHON" tools/profile_step.py --model $m; done ;;
    profile8)
      for kv in auto fp8; do
        step profile_step.jsonl "$PYTHON" tools/profile_step.py --batch 64 256 --kv-cache-dtype $kv
      done ;;
    profile8b) step profile_step.jsonl "$PYTHON" tools/profile_step.py --model qwen3-8b ;;
    startup)
      step importtime.log "$PYTHON" -X importtime -c "import torch, nanovllm"
      step startup.jsonl "$PYTHON" tools/startup_time.py
      step startup.jsonl "$PYTHON" tools/startup_time.py --checkpoint-of qwen3-0.6b \
        --checkpoint-dir "$CACHE/ckpt-qwen3-0.6b" ;;
    fp8)  # the fp8 cache's kernels, its speed and capacity, its quality on the presets' logits
      step test_kernels.log "$PYTHON" -m pytest tests/test_kernels.py -q -rA -k "fp8 or window"
      step bench_kernels_fp8.log "$PYTHON" tools/bench_kernels.py --kv-cache-dtype fp8 --sweep --out "$OUT"
      step bench_fp8.jsonl "$PYTHON" bench.py --json
      step bench_fp8.jsonl "$PYTHON" bench.py --json --kv-cache-dtype fp8
      [[ ${FP8_QUALITY:-1} == 1 ]] && kv_quality ;;
    kvquality) kv_quality ;;
    fp8wtests)  # fp8 weights: the kernels' and engine's GPU tests, then the fp8 kernels' microbenchmarks
      step test_fp8.log "$PYTHON" -m pytest tests/test_fp8_kernels.py -q -rfE
      step test_fp8.log "$PYTHON" -m pytest tests/test_moe.py -q -rfE -k "fp8 or cuda_graph"
      step bench_fp8_linear.log "$PYTHON" tools/bench_fp8.py --out "$OUT"
      step bench_kernels_moe.log "$PYTHON" tools/bench_kernels.py --only moe --out "$OUT" ;;
    fp8moe)  # fp8 experts: the fused MoE's GPU tests, then its microbenchmark (W8A8 and W8A16 beside bf16)
      step test_fp8.log "$PYTHON" -m pytest tests/test_moe.py -q -rfE -k "fp8 or cuda_graph"
      step bench_kernels_moe.log "$PYTHON" tools/bench_kernels.py --only moe ${MOE_SWEEP:+--sweep} --out "$OUT" ;;
    cascade|cascade_tests)  # cascade decode attention: its GPU tests, then (cascade) plain against cascade
      step test_cascade.log "$PYTHON" -m pytest tests/test_cascade.py -q -rfE
      [[ $phase == cascade ]] && step bench_cascade.log "$PYTHON" tools/bench_cascade.py ${CASCADE_QUICK:+--quick} ${CASCADE_MODELS:+--models $CASCADE_MODELS} ${CASCADE_PARTS:+--parts $CASCADE_PARTS} --out "$OUT" ;;
    spec|spec_tests)  # speculative decoding: its tests on CUDA, then (spec) speed against acceptance, n-gram
      step test_speculative.log "$PYTHON" -m pytest tests/test_speculative.py -q -rfE
      [[ $phase == spec ]] || continue
      step bench_spec.jsonl "$PYTHON" tools/bench_spec.py --oracle --model ${SPEC_MODELS:-qwen3-0.6b qwen3-8b} --batch ${SPEC_BATCHES:-1 4 16 64} --accept 2 3 4 ${SPEC_PROFILE:+--profile}
      step bench_spec_bench.jsonl "$PYTHON" bench.py --json --scenario batch1-ngram
      step bench_spec_bench.jsonl "$PYTHON" bench.py --json --scenario batch1 ;;
    cascade_bench) step bench_cascade.log "$PYTHON" tools/bench_cascade.py ${CASCADE_QUICK:+--quick} ${CASCADE_MODELS:+--models $CASCADE_MODELS} ${CASCADE_PARTS:+--parts $CASCADE_PARTS} --out "$OUT" ;;
    fp8skinny)  # the skinny fp8 kernel's tiles and splits over K (8B projections, 1 and 16 rows)
      step bench_fp8_skinny.log "$PYTHON" tools/bench_fp8.py --skinny-sweep --out "$OUT" ;;
    fp8wbench)  # fp8 weights and cache against bf16 in one call: bench.py, the 8B batch-1 scenario, quality
      step bench_fp8w.jsonl "$PYTHON" bench.py --model qwen3-8b --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --model qwen3-8b-fp8 --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --model qwen3-8b --quantization fp8 --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --scenario batch1-8b --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --scenario batch1-8b --model qwen3-8b-fp8 --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --scenario batch1-8b --quantization fp8 --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --json
      step bench_fp8w.jsonl "$PYTHON" bench.py --json --kv-cache-dtype fp8
      step bench_fp8w.jsonl "$PYTHON" bench.py --json --quantization fp8
      step quality_fp8w.log "$PYTHON" tools/kv_quality.py --weights --device cuda ;;
    rl)  # RL rollouts: the tests on CUDA, then update_weights / sleep / wake_up on the 8B preset
      step test_rl.log "$PYTHON" -m pytest tests/test_rl.py tests/test_update_weights.py tests/test_bench_rl.py -q -rfE
      step bench_rl.jsonl "$PYTHON" tools/bench_rl.py --model qwen3-8b --logprob-gap ;;
    probe) step fp8_probe.log "$PYTHON" tools/fp8_decode_probe.py --out "$OUT" ;;
    structured)
      structured_extra
      for flags in "" --no-handoff --no-async-scheduling; do
        step bench_structured.jsonl "$PYTHON" tools/bench_structured.py --json --work "$CACHE/bench-structured" $flags
      done
      step test_structured.log "$PYTHON" -m pytest tests/test_structured_output.py -q -rA ;;
    structured2)  # the defaults, then with torch's CPU threads at one
      structured_extra
      step bench_structured.jsonl "$PYTHON" tools/bench_structured.py --json --work "$CACHE/bench-structured"
      step bench_structured.jsonl env OMP_NUM_THREADS=1 "$PYTHON" tools/bench_structured.py --json \
        --work "$CACHE/bench-structured" ;;
    structured_phases)
      structured_extra
      for flags in "" --no-handoff; do
        step bench_structured.jsonl "$PYTHON" tools/bench_structured.py --json --phases \
          --work "$CACHE/bench-structured" $flags
      done ;;
    moe|moebench)
      if [[ $phase == moe ]]; then
        step test_moe.log "$PYTHON" -m pytest tests/test_moe.py -q -rA
        step bench_moe.log "$PYTHON" tools/bench_kernels.py --only moe --sweep --out "$OUT"
      fi
      step bench_moe.jsonl "$PYTHON" bench.py --model qwen3-30b-a3b --json
      step bench_moe.jsonl "$PYTHON" bench.py --model qwen3-30b-a3b --scenario batch1 --json ;;
    train)  # the standard library alone, and with its test suites, side by side on one GPU
      step train.log "$PYTHON" tools/train_demo_model.py --out "$OUT/demo" &
      step train_tests.log "$PYTHON" tools/train_demo_model.py --out "$OUT/demo_tests" --include-tests &
      wait ;;
    tp1) step bench_tp.jsonl "$PYTHON" bench.py --model qwen3-8b --json ;;
    tp2|tp2a)  # 2 GPUs: Qwen3-0.6B at TP 2 and the float32 TP test
      step bench_tp.jsonl "$PYTHON" bench.py --tp 2 --json
      step test_tp.log "$PYTHON" -m pytest tests/test_gpu.py -q -s -rA -k "tensor_parallel_2_float32" ;;&
    tp2|tp2b)  # 2 GPUs: Qwen3-8B at TP 2, the bf16 TP test and the dead-worker test
      step bench_tp.jsonl "$PYTHON" bench.py --model qwen3-8b --tp 2 --json
      step test_tp.log "$PYTHON" -m pytest tests/test_gpu.py -q -s -rA -k "tensor_parallel_2_bfloat16 or dead_worker" ;;
    tp2a) ;;
    tp2tests) step test_tp.log "$PYTHON" -m pytest tests/test_gpu.py -q -s -rA -k "tensor_parallel_2_bfloat16 or dead_worker" ;;
    *) echo "unknown phase $phase (bash $0 lists them)" >&2; exit 2 ;;
  esac
done
[[ -s $OUT/bench.jsonl ]] && "$PYTHON" tools/plot_bench.py "$OUT/bench.jsonl" "$OUT/bench.png" 2>/dev/null
true
