#!/usr/bin/env bash
# Builds with `--features cuda` on a machine without a GPU or a CUDA install: fetches the pieces
# of the CUDA 13.0 toolkit that candle's build needs from NVIDIA's PyPI wheels into one prefix,
# then prints the environment to build with.
#
#   env=$(scripts/cuda-toolkit.sh check) && eval "$env"   # compiler + headers: `cargo check`
#   env=$(scripts/cuda-toolkit.sh build) && eval "$env"   # + cuBLAS, cuRAND, NVRTC and a link stub for
#                                             #   libcuda: enough to link a binary (~600 MB more)
#
# The prefix is $LYCHEEMEM_CUDA_DIR (default ~/.cache/lycheemem/cuda13.0). A binary linked here
# loads the real libraries at run time from the GPU machine's driver and CUDA install (set
# LD_LIBRARY_PATH there). CUDA 13.0 because drivers from the 580 series run its PTX; newer
# toolkits emit PTX those drivers reject. CUDA_COMPUTE_CAP defaults to 90 (H100 / H200).
set -euo pipefail
mode=${1:-check}
prefix=${LYCHEEMEM_CUDA_DIR:-$HOME/.cache/lycheemem/cuda13.0}
python=${LYCHEEMEM_PYTHON:-python3}
check_wheels=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85)
link_wheels=(nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88)
case $mode in
  check) wheels=("${check_wheels[@]}") ;;
  build) wheels=("${check_wheels[@]}" "${link_wheels[@]}") ;;
  *) echo "usage: $0 check|build" >&2; exit 2 ;;
esac

root=$prefix/nvidia/cu13
stamp=$prefix/.installed-$mode
# `build` installs a superset of `check`.
if [ "$mode" = check ] && [ -f "$prefix/.installed-build" ]; then stamp=$prefix/.installed-build; fi
if [ ! -f "$stamp" ]; then
  mkdir -p "$prefix/wheels"
  echo "fetching the CUDA 13.0 $mode set from PyPI into $prefix ..." >&2
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
    -d "$prefix/wheels" "${wheels[@]}" >&2
  for spec in "${wheels[@]}"; do
    name=${spec%%==*}; version=${spec##*==}
    wheel=$(ls "$prefix/wheels/${name//-/_}-$version-"*.whl | head -1)
    "$python" -m zipfile -e "$wheel" "$prefix" >&2
  done
  chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
  if [ "$mode" = build ]; then
    (cd "$root/lib" && for l in cudart cublas cublasLt nvrtc; do ln -sf "lib$l.so.13" "lib$l.so"; done \
      && ln -sf libcurand.so.10 libcurand.so)
    # Link stub for the driver library: every cu* entry point cudarc declares, no code. The
    # binary records libcuda.so.1 and gets the driver's real one at run time.
    repo=$(cd "$(dirname "$0")/.." && pwd)
    version=$(grep -A1 '^name = "cudarc"' "$repo/Cargo.lock" | sed -n 's/^version = "\(.*\)"/\1/p')
    cargo fetch --manifest-path "$repo/Cargo.toml" >&2
    bindings=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$version"/src/driver/sys/mod.rs | head -1)
    mkdir -p "$root/lib/stubs"
    grep -oP '^\s+fn \Kcu\w+(?=\()' "$bindings" | sort -u | sed 's/.*/void &(void){}/' \
      > "$prefix/libcuda-stub.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$prefix/libcuda-stub.c"
  fi
  touch "$stamp"
fi
printf 'export CUDA_PATH=%q\n' "$root"
printf 'export PATH=%q:"$PATH"\n' "$root/bin"
echo 'export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}'
