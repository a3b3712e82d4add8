#!/usr/bin/env bash
# One benchmark run on the lent GPU machine (see BENCHMARKS.md): installs the carried wheels (dist/: cosytrt,
# .whl/: soxr, soundfile, kaldi-native-fbank; .whl_serve/ when carried: the server's) next to the machine's own torch, restores a carried torch.compile
# cache if there is one (compile_cache/cc.bin.gz.part-*), runs `python -m cosytrt.tools.bench "$@"` (the package
# tools/bench/: `trtbuild bench`) with the results in $OUT, renders the report (`python -m cosytrt.tools.bench.report`:
# $OUT/bench_tables.md and PNGs, when matplotlib is there) and hands the compile cache back in <= 15 MB parts.
# The bench itself is stopped after $BENCH_TIMEOUT_S seconds (default 480), so that the compile cache still gets
# written back inside the device call's own limit (run 2 of 2026-12-02 lost its cache to a call timeout).
#   usage (from the repo root there): BENCH_TIMEOUT_S=480 bash benchmarks/device_run.sh --suite micro --budget-s 400
#   open loop: BENCH_TIMEOUT_S=470 bash benchmarks/device_run.sh --suite open_loop --variants graphs --rates 4,8,16 \
#              --duration-s 20 --ab flow_prefix_cache --budget-s 400
set -uo pipefail
export COSYTRT_COMMIT=${COSYTRT_COMMIT:-$(cat benchmarks/COMMIT 2>/dev/null || echo unknown)}
rm -rf /tmp/site  # a warm machine keeps the last call's install: pip --target would not replace it
# .whl_serve/ (optional, git-ignored): the serve extra's wheels for cp312 (fastapi, uvicorn, websockets, pydantic...)
# that the agent suite's real server needs; fill it with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 -d .whl_serve fastapi uvicorn websockets python-multipart pydantic prometheus-client
serve=(); ls .whl_serve/*.whl >/dev/null 2>&1 && serve=(.whl_serve/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl "${serve[@]}" \
  dist/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
if ls compile_cache/cc.bin.gz.part-* >/dev/null 2>&1; then
  if cat compile_cache/cc.bin.gz.part-* | gunzip > /tmp/cc.bin; then echo "restored compile cache: $(du -h /tmp/cc.bin)"
  else echo "compile cache parts incomplete: not used"; rm -f /tmp/cc.bin; fi
fi
# other carried caches (compile_cache_*/cc.bin.gz.part-*: e.g. run 33's of the compiled variant beside the
# graphs_ar one) go into this machine's on-disk Inductor / Triton caches first, in a process of their own (run from
# /tmp: the repo root's cosytrt/ folder would shadow the installed wheel); only
# compile_cache/ is handed back (what the bench's process used, hits included)
for d in compile_cache_*/; do
  ls "$d"cc.bin.gz.part-* >/dev/null 2>&1 || continue
  if cat "$d"cc.bin.gz.part-* | gunzip > /tmp/cc_extra.bin; then
    echo "pre-loaded $d: $(cd /tmp && python3 -c 'import sys; from cosytrt.runtime.stages.compiled import load_compile_cache as l; print(l(sys.argv[1]))' /tmp/cc_extra.bin 2>&1 | tail -1)"
  else echo "compile cache parts of $d incomplete: not used"; fi
  rm -f /tmp/cc_extra.bin
done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
cd /tmp && timeout "${BENCH_TIMEOUT_S:-480}" python3 -X faulthandler -m cosytrt.tools.bench --out "$OUT" --compile-cache /tmp/cc.bin "$@" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
if [ -s "$OUT/results.json" ]; then
  python3 -m cosytrt.tools.bench.report "$OUT/results.json" --out "$OUT" > "$OUT/report_log.txt" 2>&1 \
    || echo "report failed (see report_log.txt): render it here with python -m cosytrt.tools.bench.report"
fi
if [ -s /tmp/cc.bin ]; then
  mkdir -p "$OUT/cc" && gzip -c /tmp/cc.bin | split -b 15M - "$OUT/cc/cc.bin.gz.part-" && ls -la "$OUT/cc"
fi
exit $rc
