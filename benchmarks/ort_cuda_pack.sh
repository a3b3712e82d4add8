#!/usr/bin/env bash
# Here (not on the GPU machine): onnxruntime-gpu for the lent H200 in parts small enough to travel with the working
# tree (64 MiB per device call, the tree itself ~27 MiB), into .ortgpu/ (git-ignored):
#   .ortgpu/ort-gpu-1.31.1-sm90.tar.xz.part-aa, -ab, ...  SHA256SUMS (the parts)  ARCHIVE.sha256 (the joined archive)
# onnxruntime-gpu 1.31.1 (cp312, manylinux_2_28) is the CUDA 13 build (its CUDA provider NEEDs libcudart.so.13,
# libcublas.so.13, libcublasLt.so.13, libcurand.so.10; cuDNN 9 is loaded at run time): the image's torch 2.11+cu130
# and its nvidia-* CUDA 13 wheels provide them. Packed: the python package minus the TensorRT provider (needs
# libnvinfer.so.10, absent there) and minus the CUDA provider's code for other GPUs (benchmarks/ort_fatbin_strip.py
# zeroes non-sm_90 cubins; 219 MB of fat binaries -> 77 MB that matter), compressed with xz.
#   usage: bash benchmarks/ort_cuda_pack.sh [PART_MB (default 34)] [--full: keep every GPU architecture]
set -euo pipefail
PART_MB=${1:-34}
FULL=${2:-}
VER=1.31.1
REPO=$(pwd)
W=$(mktemp -d /tmp/ortpack.XXXX)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$W" "onnxruntime-gpu==$VER"
mkdir -p "$W/x" && (cd "$W/x" && unzip -q ../onnxruntime_gpu-$VER-*.whl)
# the TensorRT provider needs libnvinfer.so.10 (absent there); libonnxruntime.so is the C API library, which the
# python module does not load (onnxruntime_pybind11_state.so links the runtime in and NEEDs no libonnxruntime.so)
rm -f "$W/x/onnxruntime/capi/libonnxruntime_providers_tensorrt.so" "$W/x/onnxruntime/capi/libonnxruntime.so.$VER"
readelf -d "$W/x/onnxruntime/capi/libonnxruntime_providers_cuda.so" | grep NEEDED
NAME=ort-gpu-$VER-sm90.tar.xz
if [ "$FULL" = "--full" ]; then NAME=ort-gpu-$VER-all.tar.xz
else python3 "$REPO/benchmarks/ort_fatbin_strip.py" "$W/x/onnxruntime/capi/libonnxruntime_providers_cuda.so" --keep 90
fi
tar -C "$W/x" -cf - onnxruntime "onnxruntime_gpu-$VER.dist-info" | xz -9 -T0 > "$W/$NAME"
rm -rf "$REPO/.ortgpu" && mkdir -p "$REPO/.ortgpu"
(cd "$W" && sha256sum "$NAME" > "$REPO/.ortgpu/ARCHIVE.sha256")
split -b "${PART_MB}M" "$W/$NAME" "$REPO/.ortgpu/$NAME.part-"
(cd "$REPO/.ortgpu" && sha256sum "$NAME".part-* > SHA256SUMS)
ls -la "$REPO/.ortgpu"
rm -rf "$W"
