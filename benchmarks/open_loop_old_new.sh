#!/usr/bin/env bash
# Old vs new runtime under the same open-loop cell, one device call (issue #18 checks of a change): installs the
# carried dist_old/*.whl and dist/*.whl (cosytrt wheels of two commits) into separate folders next to the carried
# .whl/ frontend wheels, restores a carried torch.compile cache (compile_cache/cc.bin.gz.part-*, as device_run.sh),
# then runs `python -m cosytrt.tools.bench --suite open_loop` with each, one after the other, into $OUT/old and
# $OUT/new (results.json, log.txt, tables). Extra arguments go to both benches (e.g. --rates 4 --duration-s 15);
# NEW_ARGS only to the new one (e.g. --ab for settings the old wheel does not have). DIT_STEP_S=N (default 0: off)
# first runs benchmarks/dit_step_gpu.py with each wheel for at most N seconds (the cached-hop graphs' capture memory
# and step times; $OUT/<side>/dit_step.json), saving a machine start.
#   usage: OLD_BUDGET_S=150 NEW_BUDGET_S=150 bash benchmarks/open_loop_old_new.sh --variants graphs --rates 4 ...
set -uo pipefail
: "${OUT:?set OUT}"
repo=$(pwd)
cc=()
if ls compile_cache/cc.bin.gz.part-* >/dev/null 2>&1; then
  if cat compile_cache/cc.bin.gz.part-* | gunzip > /tmp/cc.bin; then echo "restored compile cache: $(du -h /tmp/cc.bin)"; cc=(--compile-cache /tmp/cc.bin)
  else echo "compile cache parts incomplete: not used"; rm -f /tmp/cc.bin; fi
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for side in old new; do
  src=dist; [ "$side" = old ] && src=dist_old
  rm -rf /tmp/site_$side
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_$side .whl/*.whl $src/*.whl \
    || { echo "install $side failed"; continue; }
  budget_var=${side^^}_BUDGET_S
  extra=(); [ "$side" = new ] && [ -n "${NEW_ARGS:-}" ] && read -r -a extra <<< "$NEW_ARGS"
  mkdir -p "$OUT/$side"
  if [ "${DIT_STEP_S:-0}" -gt 0 ]; then
    ( cd /tmp && PYTHONPATH=/tmp/site_$side PYTHONUNBUFFERED=1 timeout "$DIT_STEP_S" \
        python3 -X faulthandler "$repo/benchmarks/dit_step_gpu.py" "$OUT/$side/dit_step.json" \
        > "$OUT/$side/dit_step_log.txt" 2>&1 )
    echo "$side dit_step exit $?"; tail -5 "$OUT/$side/dit_step_log.txt" | cut -c1-300
  fi
  ( cd /tmp && PYTHONPATH=/tmp/site_$side PYTHONUNBUFFERED=1 timeout "${!budget_var:-200}" \
      python3 -X faulthandler -m cosytrt.tools.bench --out "$OUT/$side" --budget-s "$(( ${!budget_var:-200} - 30 ))" \
      "${cc[@]}" "$@" "${extra[@]}" > "$OUT/$side/log.txt" 2>&1 )
  echo "$side exit $?"; grep -E "open loop|ready|hop check|Error|error" "$OUT/$side/log.txt" | cut -c1-400 | tail -12
  if [ -s "$OUT/$side/results.json" ]; then
    PYTHONPATH=/tmp/site_$side python3 -m cosytrt.tools.bench.report "$OUT/$side/results.json" --out "$OUT/$side" \
      > "$OUT/$side/report_log.txt" 2>&1 || echo "report $side failed"
  fi
done
# one file back (a device call returns at most 8)
tar -C "$OUT" -czf /tmp/old_new.tgz old new && rm -rf "$OUT/old" "$OUT/new" && mv /tmp/old_new.tgz "$OUT/"
