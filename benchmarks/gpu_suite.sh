#!/usr/bin/env bash
# The GPU numbers of docs/performance.md, in one go on a CUDA machine.
# Usage (repo root): bash benchmarks/gpu_suite.sh [OUT_DIR]
set -uo pipefail
out=${1:-${OUT:-/tmp}}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.28   # shepherd, worker and bare loop share one GPU
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
tokens=/tmp/pcp-synthetic-gpt2-tokens.bin
python3 -c "import numpy as np; np.random.default_rng(0).integers(0, 50257, 40_000_000, dtype=np.uint16).tofile('$tokens')"
python3 benchmarks/bench_worker_overhead.py --model gpt2 --data "$tokens" --backend cuda --compute-dtype bfloat16 \
  --attention cudnn --seq-len 1024 --batch-size 16 --inner-steps ${H:-300} --chunk-steps 50 --rounds 4 \
  --peak-flops 989e12 2>&1 | grep -v -i warning | tee "$out/worker_overhead_gpu.txt"
python3 benchmarks/bench_tensor_transfer.py --mb 498 --repeats 3 2>&1 | tee "$out/tensor_transfer_gpu_host.txt"
# one worker over N GPUs vs N one-GPU workers (docs/performance.md section 6): hosts with 2+ GPUs only
gpus=$(nvidia-smi -L | wc -l)
for n in 2 4 8; do
  [ "$n" -le "$gpus" ] || break
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 python3 benchmarks/bench_mesh.py --backend cuda --devices "$n" \
    --model gpt2 --data "$tokens" --compute-dtype bfloat16 --attention cudnn --seq-len 1024 \
    --batch-per-device 16 --chunk-steps 20 2>&1 | grep -v -i warning | tee "$out/mesh_${n}gpu.txt"
done
