#!/usr/bin/env bash
# A real run on one GPU host: one XLA-CUDA worker and one IREE-Vulkan worker (docs/performance.md, section 7),
# then GPT-2 small's step with XLA's matmuls at full float32 precision against IREE-Vulkan.
# Usage (repo root, carry .irx with IREE's and our wheels, .gl with the Vulkan loader): bash benchmarks/vulkan_mixed_run.sh
set -uo pipefail
pip install -q --no-deps --target /tmp/site2 .irx/*.whl 2>&1 | grep -v -i "warn\|notice" | tail -2
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
mkdir -p /tmp/site && for t in .irx/*.tar.xz; do tar xJf "$t" -C /tmp/site; done
chmod +x /tmp/site/iree/compiler/_mlir_libs/iree-* /tmp/site/iree/_runtime_libs/iree-* 2>/dev/null
export PYTHONPATH=/tmp/site2:/tmp/site:$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.25
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
ln -sfn ../protocol pcp_tui/protocol; ln -sfn ../backends pcp_tui/backends
port=18080
timeout 240 python3 -m pcp_tui shepherd --headless --host 127.0.0.1 --port $port --token t --workers 2 \
  --model tiny --rounds 6 --inner-steps 20 --chunk-steps 5 --token-lookup onehot --eval-every 1 > ${OUT:-/tmp}/shepherd.txt 2>&1 &
sh=$!
sleep 8
timeout 240 python3 -m pcp_tui worker --connect 127.0.0.1:$port --token t --backend cuda --id xla-cuda --quiet --log-level info > ${OUT:-/tmp}/worker_xla.txt 2>&1 &
timeout 240 python3 -m pcp_tui worker --connect 127.0.0.1:$port --token t --runtime iree --backend vulkan \
  --iree-flags=--iree-vulkan-target=ampere --id iree-vulkan --quiet --log-level info > ${OUT:-/tmp}/worker_vulkan.txt 2>&1 &
wait $sh; echo "shepherd exit $?"
tail -25 ${OUT:-/tmp}/shepherd.txt; tail -n 4 ${OUT:-/tmp}/worker_xla.txt ${OUT:-/tmp}/worker_vulkan.txt
echo "=== small, XLA matmuls at full float32 precision (no TF32)"
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 python3 benchmarks/bench_iree.py --model small --batch-size 16 --seq-len 256 \
  --xla cuda --iree vulkan --chunks 3 --compile-budget 100 --time-budget 150 --cache /tmp/iree-cache \
  --variant "onehot=lookup=onehot --iree-vulkan-target=ampere" 2>&1 | grep -v -i warning | tee ${OUT:-/tmp}/small_highest.txt | tail -8
