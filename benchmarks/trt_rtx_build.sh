#!/usr/bin/env bash
# Reproduce the TensorRT-for-RTX parse + build of the full-size DiT and HiFT on a GPU machine (issue #23).
# Needs: Python 3.12 with torch (CUDA), onnx, onnxscript, and the wheels tensorrt-rtx-cu13-libs +
# tensorrt-rtx-cu13-bindings 1.7.1.116 (pip install them, or put them in $WHEELS). TensorRT itself must NOT be
# importable (it would be chosen first). Plans are built, never run: TensorRT-RTX refuses compute capability 9.0.
#   bash benchmarks/trt_rtx_build.sh OUT_DIR [extra args of benchmarks/trt_rtx_build.py]
# Run of 2026-12-03 (benchmarks/2026-12-03-trt-rtx): on the lent H200 (64 MiB per call) the 95 MB libs wheel went in
# three 31 MiB parts (split -b 31M) over back-to-back calls into /tmp/rtx, then, with the cosytrt wheel (commit
# dab034b) and the bindings wheel carried:
#   cat /tmp/rtx/part00 /tmp/rtx/part01 part02 > /tmp/rtx/tensorrt_rtx_cu13_libs-1.7.1.116-py3-none-manylinux_2_28_x86_64.whl
#   pip install --no-index --no-deps --target /tmp/site /tmp/rtx/*.whl ./*.whl; export PYTHONPATH=/tmp/site
#   python3 trt_rtx_build.py --out $OUT --deadline 290 --workers 14
# CPU-only machine (no GPU needed: TensorRT-RTX builds ahead of time; run of 2026-12-03 in
# benchmarks/2026-12-03-trt-rtx-cpu, whose README has every command): Python 3.11 with a cp311 bindings wheel,
#   pip install --no-deps --target /tmp/rtx tensorrt-rtx-cu13-libs==1.7.1.116 tensorrt-rtx-cu13-bindings==1.7.1.116
#   PYTHONPATH=/tmp/rtx:. python3 benchmarks/trt_rtx_build.py --out OUT --device cpu --no-refusal-check \
#       --graphs hift/offline,dit/stream --dtypes float32 --chunk 1 --workers 2 --max-threads 1 --workspace-gb dit:float32=10
set -euo pipefail
OUT=${1:?usage: trt_rtx_build.sh OUT_DIR [args]}; shift
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import tensorrt_rtx_bindings as t; print('TensorRT-RTX', t.__version__)"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true
export PYTHONUNBUFFERED=1
python3 "$(dirname "$0")/trt_rtx_build.py" --out "$OUT" "$@"
