#!/usr/bin/env bash
# Two phase lists of tools/gpu/gpu_run.sh at once, one per GPU, then (optionally) a list that uses both GPUs:
#   bash tools/gpu/gpu_x2.sh "bench benchfa" "train gputests" ["tp2"]
# Each list writes to its own folder of the output directory OUT (default ./gpu-results): gpu0/, gpu1/, both/.
#   SECOND_GPU=0  runs both lists side by side on GPU 0 (e.g. tests beside training, on a machine of one GPU)
#   FIRST="bench profile"  runs those phases on GPU 0 alone before the two lists (into first/): measurements
#                 want the GPU to themselves
# TIME_LIMIT, CACHE, BASELINE and PYTHON are passed on to gpu_run.sh (TIME_LIMIT applies to each list).
set -u
if (($# < 2)); then sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
OUT=${OUT:-gpu-results}; mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
[[ -e $OUT/.gitignore ]] || echo '*' > "$OUT/.gitignore"
RUN="$(cd "$(dirname "$0")" && pwd)/gpu_run.sh"
if [[ -n ${FIRST:-} ]]; then
  echo "== GPU 0 alone: $FIRST"
  CUDA_VISIBLE_DEVICES=0 OUT="$OUT/first" bash "$RUN" $FIRST 2>&1 | tee "$OUT/first.out"
fi
CUDA_VISIBLE_DEVICES=0 OUT="$OUT/gpu0" bash "$RUN" $1 > "$OUT/gpu0.out" 2>&1 &
CUDA_VISIBLE_DEVICES=${SECOND_GPU:-1} OUT="$OUT/gpu1" bash "$RUN" $2 > "$OUT/gpu1.out" 2>&1 &
wait
echo "== GPU 0: $1"; cat "$OUT/gpu0.out"; echo "== GPU ${SECOND_GPU:-1}: $2"; cat "$OUT/gpu1.out"
if [[ -n ${3:-} ]]; then
  echo "== both GPUs: $3"
  OUT="$OUT/both" bash "$RUN" $3 2>&1 | tee "$OUT/both.out"
fi
true
