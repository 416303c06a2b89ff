#!/usr/bin/env bash
# On a 2-GPU machine: two phase lists of tools/gpu/gpu_run.sh at once, one per GPU, then (optionally) phases
# that use both GPUs. Results are archived as $OUT/results.tgz (a device call returns at most 8 files).
#   BUDGET=450 PAR=300 bash tools/gpu/gpu_x2.sh "bench benchfa" "train gputests" ["tp2"]
# The per-GPU lists get PAR seconds (default: all of BUDGET), the 2-GPU list what is left of BUDGET.
# On one GPU: SECOND_GPU=0 runs both lists side by side on GPU 0 (e.g. tests beside training), and
# FIRST="bench profile" FIRST_BUDGET=300 runs phases alone before them (measurements want the GPU alone).
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
start=$SECONDS
if [[ -n ${FIRST:-} ]]; then
  CUDA_VISIBLE_DEVICES=0 OUT=/tmp/results/first BUDGET=${FIRST_BUDGET:-300} bash tools/gpu/gpu_run.sh $FIRST \
    > /tmp/first.out 2>&1
  echo "== GPU 0 alone: $FIRST"; cat /tmp/first.out
fi
PAR=${PAR:-$((BUDGET - (SECONDS - start)))}
CUDA_VISIBLE_DEVICES=0 OUT=/tmp/results/gpu0 BUDGET=$PAR bash tools/gpu/gpu_run.sh $1 > /tmp/gpu0.out 2>&1 &
CUDA_VISIBLE_DEVICES=${SECOND_GPU:-1} OUT=/tmp/results/gpu1 BUDGET=$PAR bash tools/gpu/gpu_run.sh $2 > /tmp/gpu1.out 2>&1 &
wait
echo "== GPU 0: $1"; cat /tmp/gpu0.out; echo "== GPU ${SECOND_GPU:-1}: $2"; cat /tmp/gpu1.out
if [[ -n ${3:-} ]]; then
  OUT=/tmp/results/both BUDGET=$((BUDGET - (SECONDS - start))) bash tools/gpu/gpu_run.sh $3
fi
# trained demo models travel apart (a returned file holds at most 16 MiB)
for d in /tmp/results/gpu*/demo*; do
  [[ -d $d ]] && tar czf "$OUT/$(basename "$d").tgz" -C "$(dirname "$d")" "$(basename "$d")" --remove-files
done
tar czf "$OUT/results.tgz" -C /tmp results
cp /tmp/results/*/bench.png "$OUT/" 2>/dev/null
true
