#!/usr/bin/env bash
# Issue 29 on a 4-GPU host. Phases (arguments, in order): mesh, meshfsdp, gpu, gpu8, gpustream,
# gpustream4, cpu, cpuval, cpu4, cpuval4.
#   mesh:   bench_mesh.py --devices 4, data and fsdp, bf16 exchange (one 4-GPU worker vs four 1-GPU workers).
#   gpu:    a GPU shepherd + one --devices all worker (fsdp), GPT-2 124M bf16, 16x1024 a GPU, H=300.
#   gpu8:   the same, plain DiLoCo with --compression int8Block (a quarter of float32's bytes each way), 4 rounds.
#   gpustream: the same, Streaming DiLoCo (F=3, tau=40: each fragment's exchange overlaps 40 steps).
#   cpu:    the same with the shepherd on CPU and --validate off; cpuval: with validation on.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
ln -sfn ../protocol pcp_tui/protocol; ln -sfn ../backends pcp_tui/backends
# TRACE=1: both sides write the message trace (--trace) to $OUT.
# TOKENS=random (default): 40M uniform random GPT-2 ids, as every run of docs/performance.md section 6;
# TOKENS=stdlib: the host's Python stdlib sources as bytes (ids < 256), a corpus the model learns.
# TOKENS=walk: a learnable corpus over the whole vocabulary: each id is the last plus one of 16 random
# steps, mod 50257 (entropy floor ln 16 = 2.77; a 1024-token row spans ~7.7k distinct ids).
if [ "${TOKENS:-random}" = walk ]; then
  python3 -c "import numpy as np; s = np.random.default_rng(0).integers(0, 16, 40_000_000); (np.cumsum(s) % 50257).astype(np.uint16).tofile('/tmp/tokens.bin'); print('tokens: 40,000,000 walk ids')"
elif [ "${TOKENS:-random}" = stdlib ]; then
  python3 - <<'PY'
import pathlib, sysconfig, numpy as np
root = pathlib.Path(sysconfig.get_paths()["stdlib"]); out, n = [], 0
for f in sorted(root.rglob("*.py")):
    b = f.read_bytes(); out.append(b); n += len(b)
    if n > 40_000_000: break
data = np.frombuffer(b"".join(out), np.uint8).astype(np.uint16)
np.resize(data, 40_000_000).tofile("/tmp/tokens.bin"); print(f"tokens: {data.size:,} stdlib bytes")
PY
else
  python3 -c "import numpy as np; np.random.default_rng(0).integers(0,50257,40_000_000,dtype=np.uint16).tofile('/tmp/tokens.bin')"
fi
export PYTHONUNBUFFERED=1 PCP_TOKEN=realrun-token
printf '[sharding]\nmode = "fsdp"\n' > /tmp/fsdp.toml
summary() { python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    if "tokens_per_second" in row:
        print({k: row.get(k) for k in ("round", "train_loss", "eval_loss", "round_seconds", "compute_seconds", "tokens_per_second", "utilization")})
PY
}
mesh() {
  for sh in ${1:-data fsdp}; do
    echo "=== mesh sharding=$sh exchange=bfloat16 $(date +%T)"
    CUDA_VISIBLE_DEVICES=0,1,2,3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 timeout 200 python3 benchmarks/bench_mesh.py --backend cuda \
      --devices 4 --model gpt2 --data /tmp/tokens.bin --compute-dtype bfloat16 --attention cudnn --seq-len 1024 \
      --batch-per-device 16 --chunk-steps 20 --sharding $sh --exchange-dtype bfloat16 --graphs /tmp/g 2>&1 \
      | grep -v "^W0\|^I0" | tail -9 | tee -a $OUT/mesh_4gpu.txt
  done
}
real() {  # $1: gpu | cpu (the shepherd's platform), $2: attention, $3: name, $4: seconds, the rest: options
  echo "=== real run, shepherd on $1, attention $2, $3 $(date +%T)"
  plat=(); [ $1 = cpu ] && plat=(JAX_PLATFORMS=cpu)
  attention=$2; name=$3; limit=$4; shift 4
  env "${plat[@]}" CUDA_VISIBLE_DEVICES=0,1,2,3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.12 timeout $limit python3 -m pcp_tui shepherd \
    --headless --workers 1 --model gpt2 --data /tmp/tokens.bin --compute-dtype bfloat16 --attention $attention --seq-len 1024 \
    --batch-size 64 --inner-steps 300 --chunk-steps 20 --eval-batches 1 --port 18080 --config /tmp/fsdp.toml "$@" \
    --metrics $OUT/real_$name.jsonl ${TRACE:+--trace $OUT/trace_${name}_shepherd.jsonl} --checkpoint-dir /tmp/ck_$name > $OUT/real_${name}_shepherd.txt 2>&1 &
  sleep 5
  CUDA_VISIBLE_DEVICES=0,1,2,3 XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout $((limit - 5)) python3 -m pcp_tui worker \
    --connect 127.0.0.1:18080 --backend cuda --devices all --quiet ${TRACE:+--trace $OUT/trace_${name}_worker.jsonl} > $OUT/real_${name}_worker.txt 2>&1; echo "worker rc=$?"
  wait; grep -v "^W0\|^I0" $OUT/real_${name}_shepherd.txt | grep -v "^round\|^checkpoint" | tail -6; summary $OUT/real_$name.jsonl
}
nvidia-smi -L; python3 -c "import pcp_tui.app.cli, pcp_tui.app.api, pcp_tui.contract.keys, pcp_tui.shepherd.coordinator" || exit 1
for phase in "$@"; do
  case $phase in
    mesh) mesh ;;
    meshfsdp) mesh fsdp ;;
    gpu) real gpu cudnn gpu 240 --rounds 5 ;;
    gpu8) real gpu cudnn gpu8 220 --rounds 4 --compression int8Block ;;
    gpustream4) real gpu cudnn gpustream4 220 --rounds 4 --streaming-fragments 3 --overlap-steps 40 ;;
    gpustream3) real gpu cudnn gpustream3 170 --rounds 3 --streaming-fragments 3 --overlap-steps 40 ;;
    gpustream) real gpu cudnn gpustream 240 --rounds 5 --streaming-fragments 3 --overlap-steps 40 ;;
    cpu) real cpu xla cpu 240 --rounds 5 --validate off ;;
    cpuval) real cpu xla cpuval 300 --rounds 3 ;;
    cpu4) real cpu xla cpu4 200 --rounds 4 --validate off ;;  # the pair after validation moved
    cpuval4) real cpu xla cpuval4 240 --rounds 4 ;;           # off the rounds' path (16 rows)
  esac
done
