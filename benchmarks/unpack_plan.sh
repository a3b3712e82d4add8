#!/usr/bin/env bash
# Unpacks what a call of benchmarks/bench_plan.sh brought back (FILES_AT: the run's files folder) into DEST/JOB/
# (results.json gzipped as BENCHMARKS.md's raw folders keep it) and DEST/daemon_log.txt.
#   usage: benchmarks/unpack_plan.sh FILES_AT DEST
set -euo pipefail
src=${1:?FILES_AT}; dest=${2:?DEST}
mkdir -p "$dest"
for t in "$src"/*.tgz; do
  [ -e "$t" ] || continue
  tar xzf "$t" -C "$dest"
  j=$(basename "$t" .tgz)
  [ -f "$dest/$j/results.json" ] && gzip -f "$dest/$j/results.json"
  echo "$dest/$j: $(ls "$dest/$j" | tr '\n' ' ')"
done
[ -f "$src/daemon_log.txt" ] && cp "$src/daemon_log.txt" "$dest/daemon_log.txt"
true
