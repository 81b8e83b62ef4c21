#!/usr/bin/env bash
# benchmarks/bench_quality.py with every row in its own process, for a machine
# with many cores (each row needs about k+1 of them), then one merged table and plot.
# Usage (repo root): bash benchmarks/quality_parallel.sh OUT_DIR [STEPS] [DATA_MAX_BYTES]
set -uo pipefail
out=${1:?usage: quality_parallel.sh OUT_DIR [STEPS] [DATA_MAX_BYTES]}
steps=${2:-2000}
bytes=${3:-8000000}
export PYTHONUNBUFFERED=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
mkdir -p "$out"
# docs/quality.md's CPU table: tiny model, batch 8 x 64, chunks of 10 steps
common=(--steps "$steps" --data-max-bytes "$bytes" --outer-lr 1.0 --outer-momentum 0.5 --chunk-steps 10)
rows=(
  "averaged|--rows averaged"
  "sync|--rows sync"
  "single|--rows single"
  "h10|--rows plain --h 10"
  "h50|--rows plain --h 50"
  "h200|--rows plain --h 200"
  "h50paper|--rows plain --h 50 --outer-lr 0.7 --outer-momentum 0.9 --label-suffix , outer 0.7/0.9"
  "h50avg|--rows plain --h 50 --outer-lr 1.0 --outer-momentum 0.0 --label-suffix , outer 1.0/0"
)
for row in "${rows[@]}"; do
  name=${row%%|*}
  IFS='|' read -r _ rest <<<"$row"
  suffix=""
  if [[ $rest == *--label-suffix* ]]; then suffix=${rest#*--label-suffix }; rest=${rest%% --label-suffix*}; fi
  # shellcheck disable=SC2086
  python3 benchmarks/bench_quality.py "${common[@]}" $rest ${suffix:+--label-suffix "$suffix"} \
    --out "$out/$name" >"$out/$name.log" 2>&1 &
done
wait
python3 benchmarks/bench_quality.py --merge "$out"/*/quality.json --out "$out"
echo "all rows done"
