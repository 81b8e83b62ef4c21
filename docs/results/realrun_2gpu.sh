#!/usr/bin/env bash
# A: a shepherd (GPU or CPU) + one 2-GPU worker, GPT-2 124M, 16x1024 per GPU, H=40.
# B: a 2-process GPU site (one GPU each) vs one 2-GPU process, small model, CPU shepherd.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
ln -sfn ../protocol pcp_tui/protocol; ln -sfn ../backends pcp_tui/backends
python3 -c "import numpy as np; np.random.default_rng(0).integers(0,50257,40_000_000,dtype=np.uint16).tofile('/tmp/tokens.bin')"
export PYTHONUNBUFFERED=1 PCP_TOKEN=realrun-token
summary() { python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    if "tokens_per_second" in row:
        print({k: row.get(k) for k in ("round", "train_loss", "eval_loss", "round_seconds", "tokens_per_second", "utilization", "worker_utilization")})
PY
}
run_a() {  # $1: gpu | cpu (the shepherd's platform), $2: attention, $3: name, $4: seconds, the rest: options
  echo "=== A shepherd on $1, attention $2, $3 $(date +%T)"
  plat=(); [ $1 = cpu ] && plat=(JAX_PLATFORMS=cpu)
  attention=$2; name=$3; limit=$4; shift 4
  env "${plat[@]}" CUDA_VISIBLE_DEVICES=0,1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.12 timeout $limit python3 -m pcp_tui shepherd --headless \
    --workers 1 --model gpt2 --data /tmp/tokens.bin --compute-dtype bfloat16 --attention $attention --seq-len 1024 \
    --batch-size 32 --inner-steps 40 --chunk-steps 20 --port 18080 "$@" \
    --metrics $OUT/a_$name.jsonl --checkpoint-dir /tmp/ck_a_$name > $OUT/a_${name}_shepherd.txt 2>&1 &
  sleep 5
  CUDA_VISIBLE_DEVICES=0,1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout $((limit - 5)) python3 -m pcp_tui worker --connect 127.0.0.1:18080 \
    --backend cuda --devices all --quiet > $OUT/a_${name}_worker.txt 2>&1; echo "worker rc=$?"
  wait; grep -v "^W0\|^I0" $OUT/a_${name}_shepherd.txt | grep -v "^round\|^checkpoint" | tail -8; summary $OUT/a_$name.jsonl
}
run_b() {  # $1: site | one
  echo "=== B $1 $(date +%T)"
  JAX_PLATFORMS=cpu timeout 200 python3 -m pcp_tui shepherd --headless --workers 1 --model small --seq-len 256 \
    --batch-size 32 --inner-steps 20 --chunk-steps 10 --rounds 3 --port 18081 --metrics $OUT/b_$1.jsonl \
    --checkpoint-dir /tmp/ck_b_$1 > $OUT/b_$1_shepherd.txt 2>&1 &
  sleep 3
  if [ $1 = site ]; then
    pids=()
    for i in 0 1; do
      CUDA_VISIBLE_DEVICES=$i timeout 190 python3 -m pcp_tui worker --connect 127.0.0.1:18081 --backend cuda --quiet \
        --coordinator-address 127.0.0.1:18090 --num-processes 2 --process-id $i > $OUT/b_site_$i.txt 2>&1 &
      pids+=($!)
    done
    wait ${pids[0]}; echo "process 0 rc=$?"; wait ${pids[1]}; echo "process 1 rc=$?"
  else
    CUDA_VISIBLE_DEVICES=0,1 timeout 190 python3 -m pcp_tui worker --connect 127.0.0.1:18081 --backend cuda --devices all --quiet > $OUT/b_one.txt 2>&1; echo "worker rc=$?"
  fi
  wait; tail -3 $OUT/b_$1_shepherd.txt; summary $OUT/b_$1.jsonl
}
nvidia-smi -L; python3 -c "import pcp_tui.app.cli, pcp_tui.app.api, pcp_tui.contract.keys, pcp_tui.shepherd.coordinator" || exit 1
# the runs of docs/performance.md section 6 (each call ran some of them; device time is short)
run_a gpu cudnn gpu 260 --rounds 6 --eval-batches 2
run_a cpu xla cpu 260 --rounds 6 --eval-batches 2
run_a cpu xla validated 200 --rounds 3 --eval-batches 1
run_a cpu xla novalidate 150 --rounds 6 --eval-batches 1 --validate off
run_b site; run_b one
