#!/usr/bin/env bash
# Old vs new runtime under the same open-loop cell, one device call (issue #18 checks of a change): installs the
# carried dist_old/*.whl and dist/*.whl (cosytrt wheels of two commits) into separate folders next to the carried
# .whl/ frontend wheels, then runs `python -m cosytrt.tools.bench --suite open_loop` with each, one after the other,
# into $OUT/old and $OUT/new. Extra arguments go to the bench (e.g. --rates 4 --duration-s 15 --drain-s 8).
#   usage: OLD_BUDGET_S=150 NEW_BUDGET_S=150 bash benchmarks/open_loop_old_new.sh --variants graphs --rates 4 ...
set -uo pipefail
: "${OUT:?set OUT}"
for side in old new; do
  src=dist; [ "$side" = old ] && src=dist_old
  rm -rf /tmp/site_$side
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_$side .whl/*.whl $src/*.whl \
    || { echo "install $side failed"; continue; }
  budget_var=${side^^}_BUDGET_S
  mkdir -p "$OUT/$side"
  ( cd /tmp && PYTHONPATH=/tmp/site_$side PYTHONUNBUFFERED=1 timeout "${!budget_var:-200}" \
      python3 -X faulthandler -m cosytrt.tools.bench --out "$OUT/$side" --budget-s "$(( ${!budget_var:-200} - 30 ))" "$@" \
      > "$OUT/$side/log.txt" 2>&1 )
  echo "$side exit $?"; tail -5 "$OUT/$side/log.txt"
done
