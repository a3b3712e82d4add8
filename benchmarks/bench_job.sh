#!/usr/bin/env bash
# One open-loop job for a bench process that stays up between device calls (BENCHMARKS.md run 49: a process started
# in the background survives between calls while the machine is warm). The set-up (compiles, CUDA graphs, the first
# scheduler) took 5-6 minutes of every 10-minute call; with this only the first call pays it. The first call installs
# the carried wheels and compile cache (device_setup.sh) and starts `trtbuild bench --suite open_loop --keep-alive`
# in the background; every call queues its job (unless that job is queued, running or done already), follows the
# process's log until the job is done or WAIT_S has passed, and copies the job's results.json, tables and PNGs to
# $OUT. A job still running when the call ends keeps running: call again with the same JOB to wait for it. Fire each
# call within the machine's idle release (30 s) of the previous one, or the machine and the process are gone.
#   usage (repo root on the device): JOB=name [WAIT_S=560] [VARIANT=compiled] [CC=1] \
#     bash benchmarks/bench_job.sh --rates 8,12 --duration-s 24 --drain-s 8 --ab "ar_graph_sampling=0,ar_pace_lead_s=2"
#   CC=1: also hand the compile cache back ($OUT/cc); START_ARGS: more flags for the process (e.g. --graph-profile X)
#   carry: dist .whl benchmarks/COMMIT compile_cache (first call; later calls need only benchmarks/)
set -uo pipefail
D=${BENCHD:-/tmp/benchd}
job=${JOB:?JOB=name names the job}
[[ "$job" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "JOB must be letters, digits, '_', '.' or '-': $job"; exit 2; }
wait_s=${WAIT_S:-560}
start=$(date +%s)
mkdir -p "$D/queue" "$D/done"
export COSYTRT_COMMIT=${COSYTRT_COMMIT:-$(cat benchmarks/COMMIT 2>/dev/null || echo unknown)}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source benchmarks/device_setup.sh
if [ ! -e "$D/done/$job" ] && [ ! -e "$D/queue/$job.json" ]; then
  python3 -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "$@" > "$D/queue/$job.json.tmp" \
    && mv "$D/queue/$job.json.tmp" "$D/queue/$job.json" && echo "queued job $job: $*"
fi
if [ ! -f "$D/done/$job/DONE" ] && ! bench_alive "$D"; then
  source benchmarks/device_setup.sh --install || exit 1
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
  (cd /tmp && setsid nohup python3 -X faulthandler -m cosytrt.tools.bench --out "$D/boot" --compile-cache /tmp/cc.bin \
    --suite open_loop --variants "${VARIANT:-compiled}" --keep-alive "$D" --keep-alive-idle-s "${IDLE_S:-900}" \
    ${START_ARGS:-} < /dev/null > "$D/daemon.log" 2>&1 &)
  sleep 2
  echo "started the bench process (pid $(pgrep -f -- "--keep-alive $D " | tr '\n' ' '), log $D/daemon.log)"
fi
job_done() { [ -f "$D/done/$job/DONE" ]; }
follow_bench "$D" "$start" "$wait_s" job_done
case $? in
  0) echo "job $job: $(cat "$D/done/$job/DONE")" ;;
  1) echo "the bench process ended (see the log above)" ;;
  *) echo "job $job still running after ${wait_s}s: call again with JOB=$job" ;;
esac
cp -r "$D/done/$job/." "$OUT/" 2>/dev/null
cp "$D/daemon.log" "$OUT/daemon_log.txt"
[ -f "$OUT/DONE" ] && render_report "$OUT"
[ "${CC:-0}" = 1 ] && hand_back_cache
[ -f "$OUT/DONE" ] && grep -qx ok "$OUT/DONE"
