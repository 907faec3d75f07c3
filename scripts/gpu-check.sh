#!/usr/bin/env bash
# GPU check (issue #38). On a machine with an NVIDIA GPU: build with `--features cuda` (unless
# prebuilt binaries are given), then compare every model on the GPU with the same model on the
# CPU of the same machine — cross-encoder fixtures against PyTorch's logits, embedder vectors,
# greedy LLM text, texts/s, prefill / decode / batched-decode tok/s — and run the demo on both.
#
#   scripts/gpu-check.sh [OUT_DIR]            (default OUT_DIR: results/gpu-check)
#
# Environment:
#   LYCHEEMEM_BENCH_BIN, LYCHEEMEM_BIN   prebuilt lycheemem-bench / lycheemem (built with cuda)
#   LYCHEEMEM_SKELETONS                  run on synthetic weights made from these skeletons
#                                        (`lycheemem-bench device-check --write-skeletons DIR`);
#                                        for machines the model files cannot reach; no demo then
#   CUDA_COMPUTE_CAP                     for the build (default: read from nvidia-smi)
set -euo pipefail
# Paths given relative to the caller's folder stay valid after the cd below.
abs() { [ -z "$1" ] && return 0; realpath -m -- "$1"; }
repo=$(realpath -m -- "$(dirname "$0")/..")
out=$(abs "${1:-$repo/results/gpu-check}")
bench=$(abs "${LYCHEEMEM_BENCH_BIN:-}")
cli=$(abs "${LYCHEEMEM_BIN:-}")
skeletons=$(abs "${LYCHEEMEM_SKELETONS:-}")
cd "$repo"
if [ -n "$bench" ] && [ -z "$skeletons" ] && [ -z "$cli" ]; then
  echo "LYCHEEMEM_BENCH_BIN without LYCHEEMEM_SKELETONS also needs LYCHEEMEM_BIN (for the demo)" >&2
  exit 2
fi
mkdir -p "$out"
started=$(date +%s)
step() { echo "== $* ($(($(date +%s) - started)) s)" | tee -a "$out/log.txt"; }

step "GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
  | tee "$out/gpu.txt"

if [ -z "$bench" ]; then
  step "build with --features cuda"
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap \
    --format=csv,noheader | head -1 | tr -d .)}
  cargo build --release -p lycheemem-bench-cli -p lycheemem-cli \
    --features lycheemem-bench-cli/cuda,lycheemem-cli/cuda
  target=${CARGO_TARGET_DIR:-target}
  bench=$target/release/lycheemem-bench
  cli=$target/release/lycheemem
fi
missing=$(ldd "$bench" | grep "not found" || true)
if [ -n "$missing" ]; then
  # A prebuilt binary on a machine whose CUDA libraries sit outside the loader's path (a CUDA
  # toolkit folder, the driver's folder, pip's nvidia wheels): look there.
  for lib in $(echo "$missing" | awk '{print $1}'); do
    found=$(find /usr/local/nvidia /usr/local/cuda* /opt /usr/lib/x86_64-linux-gnu \
      -name "$lib" 2>/dev/null | head -1 || true)
    [ -n "$found" ] && export LD_LIBRARY_PATH="$(dirname "$found")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  done
  missing=$(ldd "$bench" | grep "not found" || true)
fi
if [ -n "$missing" ]; then
  echo "$missing" >&2
  echo "CUDA libraries are missing from the loader path: set LD_LIBRARY_PATH" >&2
  exit 1
fi

# A failed check row still lets the demos run; the script exits with the check's status.
status=0
step "device-check"
if [ -n "$skeletons" ]; then
  "$bench" device-check --device cuda:0 --from-skeletons "$skeletons" \
    --out "$out/device-check.md" || status=$?
else
  "$bench" device-check --device cuda:0 --out "$out/device-check.md" || status=$?
  for device in cuda:0 cpu; do
    step "demo on $device"
    demo_started=$(date +%s%N)
    "$cli" demo --device "$device" > "$out/demo-${device/:/}.txt" 2>&1
    echo "demo on $device: $(( ($(date +%s%N) - demo_started) / 1000000 )) ms" \
      | tee -a "$out/demo-times.txt"
  done
fi
step "done (device-check exit status $status)"
exit "$status"
