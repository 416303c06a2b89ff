#!/usr/bin/env bash
# One device call on the GPU machine: the phases named in the arguments, in that order. A device call may
# last 10 minutes, so every step runs under `timeout` against a deadline (BUDGET seconds, default 560) and a
# step that would overrun is cut, its log kept. Phases (see the case statement below for each command):
#   kernels   build flash-attn from the carried sdist (.gpu/; tools/gpu/flash_attn_build.py says how to fetch it),
#             kernel tests with it, kernel microbenchmarks
#   gputests  tests/test_gpu.py on one GPU (every backend, flash-attn built from the sdist); asynctest: a subset
#   suite     the whole CPU suite, run on CUDA; sampling: its sampling and API tests alone
#   bench     bench.py (Qwen3-0.6B preset, random weights) with the defaults, then with --profile;
#   benchfa / eager / sync: the same with flash-attn / --enforce-eager / --no-async-scheduling
#   llama     bench.py --model llama-3.2-1b;  hf: the workload through transformers (~4 min)
#   profile   tools/profile_step.py: where a decode step's time goes at batch 1/16/64/256, Qwen3-0.6B and -8B;
#             profile_before: the same for the tree in .old (the code before a change)
#   startup   tools/startup_time.py: LLM(...) construction, cold and warm caches, phase by phase (startup_before: .old)
#   gpu1      tests/test_gpu.py on one GPU without flash-attn (no TP tests; GPU_TESTS: a -k expression); gpu1v: the
#             same, each test's result printed as it ends (a run cut at the deadline keeps them)
#   ktests_dense  the dense-layer kernel tests alone; bench_before: bench.py of the tree in .old
#   linear    the dense-layer kernel tests, then the linear-layer microbenchmarks against cuBLAS with a tile sweep
#   scenarios bench.py --scenario batch1 / batch16 / long / prefix, and the 8B preset's default workload;
#             scenariosfa: the same with flash-attn (carry .gpu: its sdist)
#   blocksizes bench.py (default, prefix, batch16) at kvcache_block_size 16, 32, 64, 128, 256 (BLOCK_SCENARIOS:
#             the scenarios beside the default workload, default "prefix batch16")
#   fp8       the fp8-cache and sliding-window kernel tests compiled, decode microbenchmarks over an fp8 cache
#             with a tile sweep,
#             bench.py with the model's dtype and with an fp8 cache (same run), the presets' KL divergence
#             (FP8_QUALITY=0 leaves the KL divergence out)
#   train     tools/train_demo_model.py into $OUT/demo (and with --include-tests into $OUT/demo_tests)
#   ktests    the kernel tests alone (no flash-attn build)
#   onegpu    one GPU without flash-attn: test_gpu.py (no TP) and the GPU tests elsewhere, then the engine,
#             sampling and API tests on CUDA
#   ab        bench.py of the code before a change (its tree carried in the ignored folder .old) and of this
#             tree, alternating, twice each: bench_before.jsonl, bench.jsonl
#   tp1, tp2  bench.py for qwen3-8b at TP 1; at TP 2 (2 GPUs) for both presets, and the TP GPU tests
#   moe       Qwen3-MoE: tests/test_moe.py (its GPU tests: the fused kernel at Qwen3-30B-A3B's shapes, in a graph, the
#             engine on CUDA), the fused MoE kernel against a per-expert cuBLAS loop (bench_kernels.py --only moe
#             --sweep), then bench.py --model qwen3-30b-a3b (bf16 dummy weights, ~61 GB), default workload and
#             --scenario batch1; moebench: the two bench.py runs alone
#   structured structured outputs (issue 22): xgrammar and its dependencies from the carried wheels (.gpu/wheels;
#             carry .gpu), tools/bench_structured.py (64 JSON-schema requests against the same 64 unconstrained in
#             one process, Qwen3-0.6B shapes, random weights, the 151,643-token tokenizer in .gpu/bench-structured)
#             with the bitmask overlap, without it, and synchronous; then tests/test_structured_output.py on CUDA
#   kvquality the fp8 phase's KL divergence on the presets alone;  probe: tools/fp8_decode_probe.py (where fp8
#             decode's time goes);  reliability: the GPU tests of tests/test_reliability.py
#   scenarios256 batch1, batch16 and long at kvcache_block_size 256 (SCENARIOS: which)
#   fill      tools/bench_fill.py (the bitmask fill alone), then bench_structured.py with each
#             fill method (FILL_THREADS threads, default 8);  structured2: bench_structured.py with the defaults,
#             and with OMP_NUM_THREADS=1; structured3: with the deferred sampler and without, then its tests;
#             structured4: the host's time a step by phase, with each accept method and without the deferred sampler;
#             structured5: the same with the deferred sampler and without, then the tests (STRUCTURED_TESTS=0: not);
#             profile8: profile_step.py at batch 64/256, bf16 and fp8
#   profile8b profile_step.py for the 8B preset (the PDL phases pdl and pdl2 are in commit 3028407: PDL was
#             measured there and dropped)
# tools/gpu/gpu_x2.sh runs two of these at once, one per GPU.
# Logs and results go to $OUT (default ./out). Usage: bash tools/gpu/gpu_run.sh PHASE...
set -u -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET:-560}))
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u;
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"; } | tee "$OUT/env.txt"

step() {  # step LOG COMMAND...: run under the time left, append stdout to $OUT/LOG, stderr to $OUT/LOG.err
  local log=$1; shift
  local left=$((DEADLINE - SECONDS))
  if ((left < 20)); then echo "SKIPPED (no time left): $*" | tee -a "$OUT/skipped.txt"; return; fi
  echo "== $* (${left}s left)" >&2
  timeout -k 5 "$left" "$@" >>"$OUT/$log" 2>>"$OUT/$log.err"
  local rc=$?
  ((rc == 124)) && echo "CUT at the deadline: $*" | tee -a "$OUT/skipped.txt"
  tail -n 3 "$OUT/$log"
}
FA="python3 tools/gpu/with_flash_attn.py"
structured_extra() {  # xgrammar and its dependencies from the carried wheels (phases structured, fill, structured2)
  step pip_structured.log python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/structured .gpu/wheels/*.whl
  export PYTHONPATH=$PWD:/tmp/structured
}
kv_quality() {  # the KL divergence an fp8 cache costs the presets' logits (phases fp8, kvquality)
  for m in qwen3-0.6b qwen3-8b; do
    step kv_quality.jsonl python3 tools/kv_quality.py --preset $m --device cuda --prompts 4 --tokens 1024 --chunk 256
  done
}

for phase in "$@"; do
  case $phase in
    kernels)
      step test_kernels.log $FA -m pytest tests/test_kernels.py -q -rA
      step bench_kernels.log python3 tools/bench_kernels.py --out "$OUT" ${SWEEP:+--sweep} ;;
    gputests)  # all but the TP tests and asynctest's
      step test_gpu.log $FA -m pytest tests/test_gpu.py -q -s -rA \
        -k "not tensor_parallel and not async_scheduling_matches and not float32" ;;
    asynctest) step test_gpu.log python3 -m pytest tests/test_gpu.py -q -s -rA -k "async_scheduling_matches or float32" ;;
    suite) step test_suite_cuda.log python3 -m pytest tests -q -m "not gpu" -x ;;
    sampling) step test_sampling_cuda.log python3 -m pytest tests/test_sampling.py tests/test_api.py -q -rA ;;
    bench)  # Triton, CUDA Graphs, async scheduling (the defaults); then again under torch.profiler
      step bench.jsonl python3 bench.py --json
      step bench_profile.jsonl python3 bench.py --json --profile ;;
    benchfa) step bench.jsonl $FA bench.py --attention-backend flash-attn --json ;;
    eager) step bench.jsonl python3 bench.py --json --enforce-eager ;;
    sync) step bench.jsonl python3 bench.py --json --no-async-scheduling ;;
    llama) step bench_llama.jsonl python3 bench.py --model llama-3.2-1b --json ;;
    hf) step bench_hf.jsonl python3 bench.py --engine hf --json ;;
    profile)  # MODELS: the presets profiled (default both)
      for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do step profile_step.jsonl python3 tools/profile_step.py --model $m; done ;;
    profile_before)
      cp tools/profile_step.py .old/tools/
      for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
        step profile_before.jsonl env -C .old PYTHONPATH="$PWD/.old" python3 tools/profile_step.py --model $m
      done ;;
    startup)
      step importtime.log python3 -X importtime -c "import torch, nanovllm"
      step startup.jsonl python3 tools/startup_time.py ;;
    startup_before)
      cp tools/startup_time.py .old/tools/
      step startup_before.jsonl env -C .old PYTHONPATH="$PWD/.old" python3 tools/startup_time.py ;;
    gpu1) step test_gpu.log python3 -m pytest tests/test_gpu.py -q -rA -m gpu -k "${GPU_TESTS:-not tensor_parallel}" ;;
    gpu1v) step test_gpu.log python3 -m pytest tests/test_gpu.py -v -m gpu -k "${GPU_TESTS:-not tensor_parallel}" ;;
    ktests_dense) step test_kernels.log python3 -m pytest tests/test_kernels.py -q -rA -k "skinny or rms_norm" ;;
    bench_before) step bench_before.jsonl env -C .old PYTHONPATH="$PWD/.old" python3 bench.py --json ;;
    linear)
      step test_kernels.log python3 -m pytest tests/test_kernels.py -q -rA -k "skinny or rms_norm"
      step bench_linear.log python3 tools/bench_kernels.py --only linear --sweep --out "$OUT" ;;
    blocksizes)  # kvcache_block_size 16-256 (Triton): the default workload, and the prefix and batch16 scenarios
      for b in 16 32 64 128 256; do
        step bench_blocks.jsonl python3 bench.py --block-size $b --json
        for s in ${BLOCK_SCENARIOS-prefix batch16}; do step bench_blocks.jsonl python3 bench.py --block-size $b --scenario $s --json; done
      done ;;
    scenarios)  # SCENARIOS: which (default all four)
      for s in ${SCENARIOS:-batch1 batch16 long prefix}; do step bench.jsonl python3 bench.py --scenario $s --json; done
      [[ -z ${SCENARIOS:-} ]] && step bench.jsonl python3 bench.py --model qwen3-8b --json ;;
    scenariosfa)  # the scenarios and the 8B default workload with flash-attn (built from the carried sdist once)
      for s in ${SCENARIOS:-batch1 batch16 long prefix}; do
        step bench.jsonl $FA bench.py --attention-backend flash-attn --scenario $s --json
      done
      [[ -z ${SCENARIOS:-} ]] && step bench.jsonl $FA bench.py --attention-backend flash-attn --model qwen3-8b --json ;;
    fp8)  # issue 20's GPU measurements: kernels, the cache's speed and capacity, quality on the presets' logits
      step test_kernels.log python3 -m pytest tests/test_kernels.py -q -rA -k "fp8 or window"
      step bench_kernels_fp8.log python3 tools/bench_kernels.py --kv-cache-dtype fp8 --sweep --out "$OUT"
      step bench_fp8.jsonl python3 bench.py --json
      step bench_fp8.jsonl python3 bench.py --json --kv-cache-dtype fp8
      [[ ${FP8_QUALITY:-1} == 1 ]] && kv_quality ;;
    train)  # the standard library alone, and with its test suites, side by side on one GPU
      step train.log python3 tools/train_demo_model.py --out "$OUT/demo" &
      step train_tests.log python3 tools/train_demo_model.py --out "$OUT/demo_tests" --include-tests &
      wait ;;
    ktests) step test_kernels.log python3 -m pytest tests/test_kernels.py -q -rA ;;
    onegpu)  # one GPU, no flash-attn: the CUDA tests, then the engine-facing CPU tests on CUDA
      step test_gpu.log python3 -m pytest tests/test_gpu.py tests/test_reliability.py -q -rA -m gpu \
        -k "not tensor_parallel"
      step test_cuda.log python3 -m pytest tests/test_engine.py tests/test_sampling.py tests/test_api.py -q -rA \
        -m "not gpu" ;;
    ab)
      for i in $(seq "${AB_REPS:-2}"); do
        step bench_before.jsonl env -C .old PYTHONPATH="$PWD/.old" python3 bench.py --json
        step bench.jsonl python3 bench.py --json
      done ;;
    tp1) step bench_tp.jsonl python3 bench.py --model qwen3-8b --json ;;
    tp2|tp2a)  # 2 GPUs: Qwen3-0.6B at TP 2 and the float32 TP test
      step bench_tp.jsonl python3 bench.py --tp 2 --json
      step test_tp.log python3 -m pytest tests/test_gpu.py -q -s -rA -k "tensor_parallel_2_float32" ;;&
    tp2|tp2b)  # 2 GPUs: Qwen3-8B at TP 2, the bf16 TP test and the dead-worker test
      step bench_tp.jsonl python3 bench.py --model qwen3-8b --tp 2 --json
      step test_tp.log python3 -m pytest tests/test_gpu.py -q -s -rA -k "tensor_parallel_2_bfloat16 or dead_worker" ;;
    tp2a) ;;
    tp2tests) step test_tp.log python3 -m pytest tests/test_gpu.py -q -s -rA -k "tensor_parallel_2_bfloat16 or dead_worker" ;;
    moe|moebench)
      if [[ $phase == moe ]]; then
        step test_moe.log python3 -m pytest tests/test_moe.py -q -rA
        step bench_moe.log python3 tools/bench_kernels.py --only moe --sweep --out "$OUT"
      fi
      step bench_moe.jsonl python3 bench.py --model qwen3-30b-a3b --json
      step bench_moe.jsonl python3 bench.py --model qwen3-30b-a3b --scenario batch1 --json ;;
    structured)
      structured_extra
      for flags in "" --no-overlap --no-async-scheduling; do
        step bench_structured.jsonl python3 tools/bench_structured.py --json --work .gpu/bench-structured $flags
      done
      step test_structured.log python3 -m pytest tests/test_structured_output.py -q -rA ;;
    kvquality) kv_quality ;;
    fill)  # the bitmask fill alone by method and threads (tools/bench_fill.py), then bench_structured.py by method
      structured_extra
      step bench_fill.jsonl python3 tools/bench_fill.py --json --work .gpu/bench-structured --threads 1 2 4 8 16
      for method in batch pool; do
        step bench_structured.jsonl python3 tools/bench_structured.py --json --work .gpu/bench-structured \
          --fill-method $method --fill-threads ${FILL_THREADS:-8}
      done ;;
    structured2)  # bench_structured.py with the defaults, then with torch's CPU threads at one (OMP_NUM_THREADS=1)
      structured_extra
      step bench_structured.jsonl python3 tools/bench_structured.py --json --work .gpu/bench-structured
      step bench_structured.jsonl env OMP_NUM_THREADS=1 python3 tools/bench_structured.py --json \
        --work .gpu/bench-structured ;;
    structured3)  # bench_structured.py with the deferred sampler (the default) and without, then the tests on CUDA
      structured_extra
      for flags in "" --no-deferred-sampler; do
        step bench_structured.jsonl python3 tools/bench_structured.py --json --work .gpu/bench-structured $flags
      done
      step test_structured.log python3 -m pytest tests/test_structured_output.py -q -rA ;;
    structured4)  # bench_structured.py with the host's phases: the defaults, batched accepts, no deferred sampler
      structured_extra
      for flags in "" "--accept-method batch" --no-deferred-sampler; do
        step bench_structured.jsonl python3 tools/bench_structured.py --json --phases --work .gpu/bench-structured $flags
      done ;;
    structured5)  # bench_structured.py with the host's phases, with the deferred sampler and without; the tests on CUDA
      structured_extra
      for flags in "" --no-deferred-sampler; do
        step bench_structured.jsonl python3 tools/bench_structured.py --json --phases --work .gpu/bench-structured $flags
      done
      [[ ${STRUCTURED_TESTS:-1} == 1 ]] && step test_structured.log python3 -m pytest tests/test_structured_output.py -q -rA ;;
    profile8)  # where a decode step's time goes, bf16 and fp8 cache, Qwen3-0.6B at batch 64 and 256
      for kv in auto fp8; do
        step profile_step.jsonl python3 tools/profile_step.py --batch 64 256 --kv-cache-dtype $kv
      done ;;
    probe) step fp8_probe.log python3 tools/fp8_decode_probe.py --out "$OUT" ;;
    reliability) step test_reliability.log python3 -m pytest tests/test_reliability.py -q -rA -m gpu ;;
    scenarios256)  # the scenarios at the block size of 256 (the Triton default until 2026-12-01), to compare
      for s in ${SCENARIOS:-batch1 batch16 long}; do
        step bench.jsonl python3 bench.py --block-size 256 --scenario $s --json
      done ;;
    profile8b) step profile_step.jsonl python3 tools/profile_step.py --model qwen3-8b ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
[[ -s $OUT/bench.jsonl ]] && python3 tools/plot_bench.py "$OUT/bench.jsonl" "$OUT/bench.png" 2>/dev/null
# at most 8 files come back from a device call: the logs travel as one archive
(cd "$OUT" && tar czf logs.tgz --remove-files -- *.log *.err skipped.txt 2>/dev/null)
true
