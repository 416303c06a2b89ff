#!/usr/bin/env bash
# On a 2-GPU machine: two phase lists of tools/gpu_run.sh at once, one per GPU, then (optionally) phases
# that use both GPUs. Results are archived as $OUT/results.tgz (a device call returns at most 8 files).
#   BUDGET=450 PAR=300 bash tools/gpu_x2.sh "bench benchfa" "train gputests" ["tp2"]
# The per-GPU lists get PAR seconds (default: all of BUDGET), the 2-GPU list what is left of BUDGET.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-540}
start=$SECONDS
PAR=${PAR:-$BUDGET}
CUDA_VISIBLE_DEVICES=0 OUT=/tmp/results/gpu0 BUDGET=$PAR bash tools/gpu_run.sh $1 > /tmp/gpu0.out 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT=/tmp/results/gpu1 BUDGET=$PAR bash tools/gpu_run.sh $2 > /tmp/gpu1.out 2>&1 &
wait
echo "== GPU 0: $1"; cat /tmp/gpu0.out; echo "== GPU 1: $2"; cat /tmp/gpu1.out
if [[ -n ${3:-} ]]; then
  OUT=/tmp/results/both BUDGET=$((BUDGET - (SECONDS - start))) bash tools/gpu_run.sh $3
fi
# trained demo models travel apart (a returned file holds at most 16 MiB)
for d in /tmp/results/gpu*/demo*; do
  [[ -d $d ]] && tar czf "$OUT/$(basename "$d").tgz" -C "$(dirname "$d")" "$(basename "$d")" --remove-files
done
tar czf "$OUT/results.tgz" -C /tmp results
cp /tmp/results/gpu0/bench.png "$OUT/" 2>/dev/null
true
