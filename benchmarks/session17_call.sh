#!/usr/bin/env bash
# The next session's first device call (BENCHMARKS.md, runs 42-46, "Next GPU session" 1): the compiled variant under
# open-loop traffic at 1 / 4 / 8 req/s: today's defaults, AR pacing (ar_pace_lead_s=2), the event-synced id
# read-back (ar_event_sync), the first-audio hold (ar_first_audio_hold_ms=30) and the sampling inside the AR decode
# graphs with the event read-back (AB=... replaces the list),
# in that order (the bench skips what its budget does not reach), each cell with the allocator counters and a 1 s
# kernel profile (where the GPU's time goes, per worker); then the CUDA tests of the id read-back and the AR graphs,
# and the full-size LM's decode step alone against its bandwidth floor (`ar_gpu_step --kernels`) in the time left.
#   usage (repo root on the device): TOTAL_S=570 bash benchmarks/session17_call.sh
#   carry: dist .whl compile_cache benchmarks/COMMIT .whl_test
set -u
start=$(date +%s)
total=${TOTAL_S:-570}
open_loop=${OPEN_LOOP_S:-450}
BENCH_TIMEOUT_S=$open_loop bash benchmarks/device_run.sh --suite open_loop --variants compiled --rates 1,4,8 \
  --duration-s 12 --drain-s 6 --budget-s $(( open_loop - 40 )) --kernel-profile-s 1 \
  --ab "${AB:-ar_graph_sampling=0,ar_pace_lead_s=2,ar_event_sync=1,ar_first_audio_hold_ms=30,ar_graph_sampling=1+ar_event_sync=1}"
rc=$?
if ls .whl_test/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyt .whl_test/*.whl
  PYTHONPATH=/tmp/site:/tmp/pyt timeout 60 python3 -P -m pytest -q -p no:cacheprovider tests/test_ids_to_host.py \
    tests/test_ar_graphs.py > "$OUT/pytest_cuda.txt" 2>&1
  tail -3 "$OUT/pytest_cuda.txt"
fi
left=$(( total - ($(date +%s) - start) ))
if [ "$left" -gt 45 ]; then
  (cd /tmp && PYTHONPATH=/tmp/site timeout $(( left - 10 )) python3 -m cosytrt.tools.bench.ar_gpu_step --kernels \
    --json "$OUT/ar_gpu_step.json") 2>&1 | tee "$OUT/ar_gpu_step.md" | tail -15
else
  echo "ar_gpu_step skipped: ${left} s left"
fi
exit $rc
