#!/usr/bin/env bash
# IREE-Vulkan against XLA-CUDA on one GPU: several IREE builds of GPT-2's train_chunk timed
# against one XLA baseline, then where the time goes, dispatch by dispatch (docs/performance.md, 7).
# Usage (repo root, on the CUDA host; ONE device command, 4-6 minutes, at most 8):
#   bash benchmarks/vulkan_matrix.sh [OUT_DIR]
# Needs: IREE's wheels (carry .irx, made by ../shared/device/iree-wheels.sh) and the Vulkan
# loader (carry .gl, see the device README); both are unpacked here when present.
set -uo pipefail
out=${1:-${OUT:-/tmp}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3   # XLA and Vulkan share the GPU
if [ -d .gl ]; then for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig; fi
if [ -d .irx ]; then
  mkdir -p /tmp/site && for t in .irx/*.tar.xz; do tar xJf "$t" -C /tmp/site; done
  chmod +x /tmp/site/iree/compiler/_mlir_libs/iree-* /tmp/site/iree/_runtime_libs/iree-* 2>/dev/null
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/iree/_runtime_libs:$PATH
fi
[ -e /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] &&
  export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import jax, iree.compiler as c; print('jax', jax.__version__, jax.devices()); print(c.__file__)"
ampere=--iree-vulkan-target=ampere
split=--iree-dispatch-creation-enable-split-reduction
# GPT-2 tiny, 8x128, 5 steps a call. "gather" is the export before this change's --token-lookup.
timeout 230 python3 benchmarks/bench_iree.py --xla cuda --iree vulkan --chunks 7 \
  --compile-budget 80 --time-budget 170 --cache /tmp/iree-cache --dump-modules /tmp/vulkan-modules \
  --variant "onehot=lookup=onehot $ampere" \
  --variant "gather=$ampere" \
  --variant "onehot+unroll=lookup=onehot unroll=5 $ampere" \
  --variant "onehot+split=lookup=onehot $ampere $split" \
  --variant "onehot+bda=lookup=onehot $ampere --iree-vulkan-dispatch-abi=bda" \
  --variant "onehot+max-concurrency=lookup=onehot $ampere --iree-stream-partitioning-favor=max-concurrency" \
  2>&1 | grep -v -i warning | tee "$out/vulkan_tiny.txt"
# Where a call's GPU time goes, kernel by kernel: gather (today's export), onehot, onehot unrolled.
for build in gather onehot onehot+unroll; do
  [ -f "/tmp/vulkan-modules/$build/benchmark.sh" ] || continue
  echo "== $build: iree-benchmark-module --dispatch_statistics, the slowest dispatches"
  timeout 20 bash "/tmp/vulkan-modules/$build/benchmark.sh" --dispatch_statistics \
    2>&1 | grep -E "BM_main|rror" | head -36
done 2>&1 | tee "$out/vulkan_tiny_dispatches.txt"
# GPT-2 small, 16x256: never timed on Vulkan. Compiles here (2 loaded cores): onehot 15 s,
# gather+split 97 s, onehot+unroll 187 s (skipped if the budget runs out: tiny measures unroll).
timeout 170 python3 benchmarks/bench_iree.py --model small --batch-size 16 --seq-len 256 \
  --xla cuda --iree vulkan --chunks 5 --compile-budget 100 --time-budget 130 --cache /tmp/iree-cache \
  --variant "onehot=lookup=onehot $ampere" \
  --variant "gather+split=$ampere $split" \
  --variant "onehot+unroll=lookup=onehot unroll=5 $ampere" \
  2>&1 | grep -v -i warning | tee "$out/vulkan_small.txt"
