#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
ln -sfn ../protocol pcp_tui/protocol; ln -sfn ../backends pcp_tui/backends
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 CUDA_VISIBLE_DEVICES=0,1
python3 -c "import numpy as np; np.random.default_rng(0).integers(0,50257,40_000_000,dtype=np.uint16).tofile('/tmp/tokens.bin')"
nvidia-smi -L; python3 -c "import jax; print(jax.__version__, jax.devices())"
for run in "data float32" "data bfloat16" "fsdp float32" "fsdp bfloat16"; do
  set -- $run; sh=$1; ex=$2
  echo "=== sharding=$sh exchange=$ex $(date +%T)"
  timeout 170 python3 benchmarks/bench_mesh.py --backend cuda --devices 2 --model gpt2 \
    --data /tmp/tokens.bin --compute-dtype bfloat16 --attention cudnn --seq-len 1024 --batch-per-device 16 \
    --chunk-steps 20 --sharding $sh --exchange-dtype $ex --graphs /tmp/g 2>&1 | grep -v "^W0\|^I0" | tail -9 | tee -a $OUT/mesh_exchange.txt
done
