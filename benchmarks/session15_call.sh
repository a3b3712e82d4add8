#!/usr/bin/env bash
# Fifteenth session's device call (BENCHMARKS.md): the compiled variant with regional compilation under open-loop
# traffic, with and without the sampling inside the AR decode graphs; then the CUDA tests of the sampler; if the
# compiled set-up failed early, the graphs_ar variant with the same A/B in the time left.
#   usage (repo root on the device): TOTAL_S=570 bash benchmarks/session15_call.sh
#   carry: dist .whl compile_cache compile_cache_run33 benchmarks/COMMIT .whl_test (device_run.sh pre-loads run 33's
#   cache of the compiled variant beside the graphs_ar one)
set -u
start=$(date +%s)
total=${TOTAL_S:-570}
COSYTRT_COMPILE_SCOPE=regional BENCH_TIMEOUT_S=${COMPILED_S:-470} bash benchmarks/device_run.sh --suite open_loop \
  --variants compiled --rates 1,4,8 --duration-s 12 --drain-s 6 --budget-s $(( ${COMPILED_S:-470} - 30 )) \
  --ab "ar_graph_sampling=0,ar_graph_sampling=1"
rc=$?
python3 -m pip install -q --no-index --no-deps --target /tmp/pyt .whl_test/*.whl
PYTHONPATH=/tmp/site:/tmp/pyt timeout 70 python3 -P -m pytest -q -p no:cacheprovider tests/test_sampling_exact.py \
  tests/test_ar_graphs.py > "$OUT/pytest_cuda.txt" 2>&1
tail -5 "$OUT/pytest_cuda.txt"
left=$(( total - ($(date +%s) - start) ))
if [ "$rc" -ne 0 ] && [ "$left" -gt 200 ]; then
  echo "compiled variant rc=$rc; graphs_ar in the ${left} s left"
  mkdir -p "$OUT/graphs_ar"
  OUT="$OUT/graphs_ar" BENCH_TIMEOUT_S=$(( left - 15 )) bash benchmarks/device_run.sh --suite open_loop \
    --variants graphs_ar --rates 1,4,8 --duration-s 12 --drain-s 6 --budget-s $(( left - 45 )) \
    --ab "ar_graph_sampling=0,ar_graph_sampling=1"
fi
exit $rc
