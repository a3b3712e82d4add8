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
source benchmarks/device_setup.sh --install || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
cd /tmp && timeout "${BENCH_TIMEOUT_S:-480}" python3 -X faulthandler -m cosytrt.tools.bench --out "$OUT" --compile-cache /tmp/cc.bin "$@" 2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
render_report "$OUT"
hand_back_cache
exit $rc
