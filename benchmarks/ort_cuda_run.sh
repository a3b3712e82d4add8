#!/usr/bin/env bash
# ONNX Runtime on CUDA on the lent H200, and the compiled engine set's set-up time (issue 22). Run from the repo root
# on the device, one STEP per device call (each call is limited to 10 minutes; /tmp survives while the machine is
# warm, 30 s after a call, so the calls must follow each other at once):
#
#   bash benchmarks/ort_cuda_run.sh STEP [STEP ...]
#
#   part            stash the carried onnxruntime-gpu parts (.ortgpu/*.part-*, SHA256SUMS) in /tmp/ortparts
#                   (every step does this first, so any call can carry a part)
#   install         join + verify + unpack them to /tmp/ortsite; environment report (providers, TensorRT library)
#   model           full-size model directory with seeded random weights (/tmp/full_model)
#   fp32            ORT engine set, full-size architecture, float32 (trtbuild build --backend onnxruntime --device
#                   cuda), then `trtbuild parity` on it
#   fp16            the same with the DiT exported in float16 (HiFT stays float32: reused from the fp32 set)
#   build32 parity32 build16 parity16   the halves of fp32 / fp16, when one call cannot hold both
#   time            DiT / HiFT per bucket: ORT-CUDA (I/O binding + CUDA graph per bucket) vs the compiled torch
#                   function in a CUDA graph vs the eager module's CUDA graph
#   compiled-build  trtbuild build --backend compiled (the cold compile = the cold set-up), empty Inductor caches
#   compiled-load   TTS.load(engines=<that set>) in a fresh process with empty Inductor caches (a new machine)
#   graphs-load     TTS.load without compile (eager + CUDA graphs), the no-compile baseline
#   quick           `trtbuild build --model random-full --profile $QUICK_PROFILE (default: the fp16 profile above;
#                   a profile with the quick matrix's shapes avoids its eager fallbacks) --backend onnxruntime`,
#                   then the serving quick matrix with it (`bench --variants engines,graphs --engines ...`; set
#                   QUICK_VARIANTS=engines,compiled for the compiled variant: minutes of compile without a cache)
#   hiftprobe       issue 22: benchmarks/hift_ort_probe.py --ops (HiFT intermediates and every conv shape, ORT-CUDA
#                   vs eager / float64; PROBE_BATCH=8 for b8), $OUT/hift_ort_probe.json
#   hiftfix         issue 22: HiFT-only fp32 sets (random-full, offline b2/b8 x t256/t512) without and with the
#                   export options reduce_phase + stft_matmul (HIFT_VARIANTS="plain fixed"), each through
#                   trtbuild parity ($OUT/parity_hift_*.json, one line per check with max abs / SNR in the log)
#   serve           offline requests at concurrency 1 and 8 through TTS.load with the ORT set (fp16 if built) vs
#                   eager + graphs (SERVE_VARIANTS=ort,graphs,compiled adds the compiled variant: minutes of compile)
#
# Carried (see the report / BENCHMARKS): `.ortgpu` parts, `.whl` (soxr, soundfile, kaldi-native-fbank, polygraphy,
# cffi, pycparser), optionally `compile_cache` (cc.bin.gz.part-*, as device_run.sh). Results: $OUT/ort_cuda.json,
# $OUT/ort_cuda_*.md, $OUT/parity_*.json, $OUT/log_<step>.txt. Every step logs, runs under its own timeout and a
# failing step does not stop the next one.
set -x
set -u -o pipefail
REPO=$(pwd)
OUT=${OUT:-/tmp/ort_out}
mkdir -p "$OUT" /tmp/ortparts
export PYTHONUNBUFFERED=1 COSYTRT_COMMIT=${COSYTRT_COMMIT:-$(cat benchmarks/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}  # seconds per python command (a device call has 600 s in all)
PROFILE_ORT=/tmp/ort_profile.yaml

stash_parts() {
  if ls .ortgpu/*.part-* >/dev/null 2>&1; then cp -v .ortgpu/*.part-* /tmp/ortparts/; fi
  for f in SHA256SUMS ARCHIVE.sha256; do [ -f .ortgpu/$f ] && cp -v .ortgpu/$f /tmp/ortparts/; done
  ls -la /tmp/ortparts
}

py_env() {
  # the source tree as the `cosytrt` package (no wheel needed), carried wheels, onnxruntime-gpu first on the path
  cp cosytrt/*.py /tmp/cosytrt_src/cosytrt/ 2>/dev/null || true
  if [ ! -d /tmp/cosytrt_src/cosytrt ]; then
    mkdir -p /tmp/cosytrt_src/cosytrt
    cp cosytrt/*.py /tmp/cosytrt_src/cosytrt/
    for d in */; do d=${d%/}
      case "$d" in tests|benchmarks|cosytrt) continue;; esac
      [ -f "$d/__init__.py" ] && ln -sfn "$REPO/$d" "/tmp/cosytrt_src/cosytrt/$d"
    done
    ls -la /tmp/cosytrt_src/cosytrt
  fi
  if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      || echo "WARN: carried wheels did not install"
  fi
  export PYTHONPATH=/tmp/ortsite:/tmp/cosytrt_src:/tmp/site
  # onnxruntime-gpu 1.31.1's CUDA provider NEEDs libcublas(Lt).so.13, libcurand.so.10, libcudart.so.13 (and loads
  # cuDNN 9): the image's nvidia-* wheels hold them; torch (imported first by cosytrt) loads most of them anyway
  local sp; sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  local libs; libs=$(find "$sp/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd: -)
  export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if [ ! -f /tmp/cc.bin ] && ls compile_cache/cc.bin.gz.part-* >/dev/null 2>&1; then
    cat compile_cache/cc.bin.gz.part-* | gunzip > /tmp/cc.bin || rm -f /tmp/cc.bin
  fi
}

step_install() {
  if [ -d /tmp/ortsite/onnxruntime ]; then echo "onnxruntime-gpu already unpacked"; else
    ( cd /tmp/ortparts && sha256sum -c SHA256SUMS ) || { echo "FAIL: parts missing or corrupt"; return 1; }
    local name; name=$(awk '{print $2}' /tmp/ortparts/ARCHIVE.sha256)
    cat /tmp/ortparts/"$name".part-* > /tmp/ortparts/"$name"
    ( cd /tmp/ortparts && sha256sum -c ARCHIVE.sha256 ) || { echo "FAIL: joined archive corrupt"; return 1; }
    mkdir -p /tmp/ortsite
    if command -v xz >/dev/null; then tar -C /tmp/ortsite -xJf /tmp/ortparts/"$name"
    else python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('/tmp/ortsite')" /tmp/ortparts/"$name"; fi
    rm -f /tmp/ortparts/"$name"; du -sh /tmp/ortsite
  fi
  cd /tmp && python3 -c 'import torch, onnxruntime as o; print(o.__version__, o.__file__, o.get_available_providers())'
  cd /tmp && timeout "$STEP_TIMEOUT" python3 "$REPO/benchmarks/ort_cuda_bench.py" env --out "$OUT"
  # the smallest CUDA EP session: a MatMul through I/O binding on torch tensors, with a CUDA graph
  cd /tmp && timeout 120 python3 - <<'EOF'
import torch, onnx.helper as h, onnxruntime as ort, numpy as np
g = h.make_graph([h.make_node("MatMul", ["a", "b"], ["c"])], "g",
                 [h.make_tensor_value_info("a", 1, [64, 64]), h.make_tensor_value_info("b", 1, [64, 64])],
                 [h.make_tensor_value_info("c", 1, [64, 64])])
m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)]); m.ir_version = 9
s = ort.InferenceSession(m.SerializeToString(), providers=[("CUDAExecutionProvider", {"enable_cuda_graph": "1"})])
a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda"); c = torch.empty(64, 64, device="cuda")
io = s.io_binding()
for n, t in (("a", a), ("b", b)): io.bind_input(n, "cuda", 0, np.float32, list(t.shape), t.data_ptr())
io.bind_output("c", "cuda", 0, np.float32, [64, 64], c.data_ptr())
for _ in range(4): s.run_with_iobinding(io)
print("CUDA EP + CUDA graph + I/O binding: max err", (c - a @ b).abs().max().item(), s.get_providers())
EOF
}

write_profile() {  # few buckets: every static bucket is one ORT session (its own weights) with its own CUDA graph
  cat > "$PROFILE_ORT" <<EOF
model: full
description: ORT-CUDA benchmark buckets (issue 22)
dtype: $1
max_padding_waste: 1.5
stages:
  dit:
    dtype: $1
    stream: {batch: [2, 8], frames: [200, 450]}
    offline: {batch: [2, 8], frames: [256, 768]}
  hift:
    dtype: float32
    stream: {batch: [1, 4], frames: [96, 192]}
    offline: {batch: [2, 8], frames: [256, 512]}
EOF
}

step_model() {
  [ -f /tmp/full_model/flow.pt ] && { echo "model exists"; return 0; }
  cd /tmp && python3 "$REPO/benchmarks/ort_cuda_bench.py" model /tmp/full_model --out "$OUT"
}

ort_build() {  # $1 dtype, $2 folder
  [ -f /tmp/full_model/flow.pt ] || step_model
  write_profile "$1"
  if [ "$1" != float32 ] && [ -d /tmp/es_float32 ] && [ ! -d "$2" ]; then cp -r /tmp/es_float32 "$2"; fi  # HiFT reused
  cd /tmp && time timeout "$STEP_TIMEOUT" python3 -X faulthandler -m cosytrt.tools.trtbuild build \
    --model /tmp/full_model --profile "$PROFILE_ORT" --backend onnxruntime --device cuda --out "$2" --quiet
  local rc=$?
  cp "$2/manifest.json" "$OUT/manifest_$1.json" || true
  return $rc
}

ort_parity() {  # $1 dtype, $2 folder
  [ -f "$2/manifest.json" ] || { echo "no engine set $2"; return 1; }
  cd /tmp && time timeout "$STEP_TIMEOUT" python3 -X faulthandler -m cosytrt.tools.trtbuild parity --engines "$2" \
    --device cuda ${PARITY_ARGS:-} --json > "$OUT/parity_$1.json"
  local rc=$?
  echo "parity $1 exit $rc"
  parity_summary "$OUT/parity_$1.json"
  return $rc
}

parity_summary() {  # one line per check with its numbers (the JSON has them at the top level of each check)
  python3 - "$1" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
print("parity passed:", r.get("passed"))
for c in r.get("checks", []):
    f = lambda k, fmt: format(c[k], fmt) if isinstance(c.get(k), (int, float)) else str(c.get(k))
    print(f"{'ok  ' if c.get('passed') else 'FAIL'} {c.get('name'):44s} max_abs {f('max_abs_err', '.3e')} "
          f"SNR {f('snr_db', '.1f')} dB  {c.get('note', '')[:160]}")
PY
}

step_hiftprobe() {  # issue 22: where the fp32 HiFT ORT-CUDA engine leaves eager (intermediates, every conv shape)
  cd /tmp && timeout "$STEP_TIMEOUT" python3 -X faulthandler "$REPO/benchmarks/hift_ort_probe.py" --frames 256 512 \
    --batch ${PROBE_BATCH:-2} --ops --out "$OUT"
}

step_hiftfix() {  # issue 22: HiFT-only fp32 sets, plain and with the export options, each through trtbuild parity
  local v opts
  for v in ${HIFT_VARIANTS:-plain fixed}; do
    opts="{}"; [ "$v" = fixed ] && opts="{reduce_phase: true, stft_matmul: true}"
    cat > /tmp/hift_$v.yaml <<YAML
model: full
description: HiFT-only fp32 ORT set, issue 22 ($v)
dtype: float32
max_padding_waste: 1.5
stages:
  hift:
    dtype: float32
    options: $opts
    offline: {batch: [2, 8], frames: [256, 512]}
YAML
    ( cd /tmp && timeout 240 python3 -m cosytrt.tools.trtbuild build --model random-full --profile /tmp/hift_$v.yaml \
        --backend onnxruntime --device cuda --out /tmp/es_hift_$v --quiet \
      && timeout 240 python3 -m cosytrt.tools.trtbuild parity --engines /tmp/es_hift_$v --device cuda --json \
        > "$OUT/parity_hift_$v.json" )
    echo "hift $v exit $?"; parity_summary "$OUT/parity_hift_$v.json"
  done
}

step_time() {
  local sets=""
  for d in /tmp/es_float32 /tmp/es_float16; do [ -f "$d/manifest.json" ] && sets="${sets:+$sets,}$d"; done
  [ -n "$sets" ] || { echo "no ORT engine set built yet (run fp32 first)"; return 1; }
  cd /tmp && timeout "$STEP_TIMEOUT" python3 -X faulthandler "$REPO/benchmarks/ort_cuda_bench.py" time \
    --sets "$sets" --out "$OUT" \
    ${TIME_ARGS:-} $( [ -f /tmp/cc.bin ] && echo --compile-cache /tmp/cc.bin )
}

fresh_caches() {  # empty Inductor / Triton caches: what a new machine has
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/inductor.XXXX) TRITON_CACHE_DIR=$(mktemp -d /tmp/triton.XXXX)
}

step_compiled_build() {
  [ -f /tmp/full_model/flow.pt ] || step_model
  ( fresh_caches; cd /tmp && time timeout "$STEP_TIMEOUT" python3 -X faulthandler -m cosytrt.tools.trtbuild build \
      --model /tmp/full_model --profile h200-graphs --backend compiled --device cuda --out /tmp/es_compiled --quiet )
  cp /tmp/es_compiled/manifest.json "$OUT/manifest_compiled.json" || true
  python3 -c "import json; m=json.load(open('/tmp/es_compiled/manifest.json')); c=m['compile_cache']; print('cold compile (build) s:', c['compile_seconds'], 'cache MB:', c['bytes']/1e6, 'graphs:', c['graphs'])" || true
}

step_compiled_load() {
  ( fresh_caches; cd /tmp && timeout "$STEP_TIMEOUT" python3 -X faulthandler "$REPO/benchmarks/ort_cuda_bench.py" \
      setup --mode set \
      --engines /tmp/es_compiled --model /tmp/full_model --out "$OUT" )
}

step_serve() {
  local es=/tmp/es_float16; [ -f $es/manifest.json ] || es=/tmp/es_float32
  cd /tmp && timeout "$STEP_TIMEOUT" python3 -X faulthandler "$REPO/benchmarks/ort_cuda_bench.py" serve \
    --engines $es --model /tmp/full_model --variants "${SERVE_VARIANTS:-ort,graphs}" --out "$OUT" \
    $( [ -f /tmp/cc.bin ] && echo --compile-cache /tmp/cc.bin )
}

step_quick() {  # the serving quick matrix through an ORT set of the bench's own weights, beside torch variants
  local es=/tmp/es_quick
  if [ ! -f $es/manifest.json ]; then
    local prof=${QUICK_PROFILE:-}
    if [ -z "$prof" ]; then write_profile float16; prof=$PROFILE_ORT; fi  # ORT's CUDA EP lacks many bf16 kernels
    cd /tmp && time timeout "$STEP_TIMEOUT" python3 -X faulthandler -m cosytrt.tools.trtbuild build --model random-full \
      --profile "$prof" --backend onnxruntime --device cuda --out $es --quiet || return 1
  fi
  cd /tmp && timeout "$STEP_TIMEOUT" python3 -X faulthandler -m cosytrt.tools.bench --suite serving --cells quick \
    --variants "${QUICK_VARIANTS:-engines,graphs}" --engines $es --out "$OUT/quick" --budget-s $((STEP_TIMEOUT - 30)) \
    $( [ -f /tmp/cc.bin ] && echo --compile-cache /tmp/cc.bin )
}

step_graphs_load() {
  ( fresh_caches; cd /tmp && timeout "$STEP_TIMEOUT" python3 -X faulthandler "$REPO/benchmarks/ort_cuda_bench.py" \
      setup --mode graphs \
      --model /tmp/full_model --out "$OUT" )
}

run_step() {
  local s=$1 rc
  echo "=== step $s $(date -u +%T)"
  case "$s" in
    part) rc=0 ;;  # done above for every call
    install) step_install; rc=$? ;;
    model) step_model; rc=$? ;;
    fp32) ort_build float32 /tmp/es_float32 && ort_parity float32 /tmp/es_float32; rc=$? ;;
    fp16) ort_build float16 /tmp/es_float16 && ort_parity float16 /tmp/es_float16; rc=$? ;;
    build32) ort_build float32 /tmp/es_float32; rc=$? ;;
    parity32) ort_parity float32 /tmp/es_float32; rc=$? ;;
    build16) ort_build float16 /tmp/es_float16; rc=$? ;;
    parity16) ort_parity float16 /tmp/es_float16; rc=$? ;;
    time) step_time; rc=$? ;;
    compiled-build) step_compiled_build; rc=$? ;;
    compiled-load) step_compiled_load; rc=$? ;;
    graphs-load) step_graphs_load; rc=$? ;;
    serve) step_serve; rc=$? ;;
    quick) step_quick; rc=$? ;;
    hiftprobe) step_hiftprobe; rc=$? ;;
    hiftfix) step_hiftfix; rc=$? ;;
    *) echo "unknown step $s"; rc=2 ;;
  esac
  echo "=== step $s exit $rc $(date -u +%T)"
  cd "$REPO"
}

stash_parts
py_env
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv || true
[ $# -gt 0 ] || set -- part
for s in "$@"; do
  run_step "$s" 2>&1 | tee "$OUT/log_$s.txt"
done
ls -la "$OUT"
exit 0
