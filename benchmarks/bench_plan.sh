#!/usr/bin/env bash
# A whole session's open-loop jobs for one bench process, in as few device calls as the work takes (session 29: of
# 1800 s of device time, 1556 s went to refused starts; a call that finds a machine must bring back all it can).
# bench_job.sh follows one job per call because a call brings back at most 8 files (each job: results.json, tables,
# PNGs, the log). This queues every job of the PLAN at once (the bench process runs them in order, so no job waits
# for the next call to be queued), then waits until all are done or WAIT_S has passed, and packs each job that
# finished and was not brought back yet into ONE file, $OUT/JOB.tgz (its results, rendered tables and PNGs), plus
# $OUT/daemon_log.txt — so one call brings back up to 6 jobs (3 with CC=1: the compile cache in <= 15 MB parts under
# $OUT/cc: a cold compiled set-up is ~300 s, with the cache ~110 s, run 68; 179 MB raw is ~29 MB gzipped, run 34).
# Call again (within 30 s: the machine's idle release) with the same PLAN to collect the rest.
#   usage (repo root on the device): PLAN=benchmarks/plans/NAME.txt [WAIT_S=520] [CC=1] [VARIANT=compiled] \
#     bash benchmarks/bench_plan.sh
#   PLAN: one job per line, "NAME FLAGS..." (open-loop bench flags as bench_job.sh takes them, quoted as in a shell;
#   a line starting with '#' is a comment); unpack here with: benchmarks/unpack_plan.sh FILES_AT DEST
#   carry: dist .whl benchmarks/COMMIT [compile_cache] (the first call; later calls need only the repo)
set -uo pipefail
plan=${PLAN:?PLAN=file lists the jobs}
D=${BENCHD:-/tmp/benchd}
wait_s=${WAIT_S:-520}
start=$(date +%s)
mkdir -p "$D/fetched"
source benchmarks/device_setup.sh  # follow_bench, pack_job, hand_back_cache
jobs=()
while read -r name rest; do
  [ -z "$name" ] || [[ "$name" == \#* ]] && continue
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "job names are letters, digits, '_', '.' or '-': $name"; exit 2; }
  jobs+=("$name")
  # queues the job (once) and starts the bench process if none runs; returns at once (WAIT_S=0, its own $OUT)
  eval "args=($rest)"  # the flags as a shell would split them (quotes kept together)
  OUT=$(mktemp -d) JOB=$name WAIT_S=0 bash benchmarks/bench_job.sh "${args[@]}" > "$D/queue_$name.log" 2>&1
  grep -E "^(queued|started)" "$D/queue_$name.log" || tail -5 "$D/queue_$name.log"  # (an install that failed)
  sleep 0.1  # the process takes the oldest queue file first (by mtime; same mtime: by name)
done < "$plan"
[ ${#jobs[@]} -gt 0 ] || { echo "no jobs in $plan"; exit 2; }
all_done() { local j; for j in "${jobs[@]}"; do [ -f "$D/done/$j/DONE" ] || return 1; done; }
follow_bench "$D" "$start" "$wait_s" all_done
case $? in
  0) echo "every job of $plan is done" ;;
  1) echo "the bench process ended (see the log above)" ;;
  *) echo "jobs still to run after ${wait_s}s: call again" ;;
esac
packed=0; most=6  # a call brings back at most 8 files: the jobs, the log and (CC=1) up to 3 cache parts
[ "${CC:-0}" = 1 ] && most=3
for j in "${jobs[@]}"; do
  if [ -f "$D/done/$j/DONE" ] && [ ! -e "$D/fetched/$j" ] && [ "$packed" -lt "$most" ]; then
    pack_job "$D/done/$j" "$OUT/$j.tgz" && touch "$D/fetched/$j" && packed=$((packed + 1))
    echo "job $j: $(cat "$D/done/$j/DONE") -> $j.tgz"
  fi
done
[ -f "$D/daemon.log" ] && cp "$D/daemon.log" "$OUT/daemon_log.txt"
[ "${CC:-0}" = 1 ] && hand_back_cache
true
