#!/usr/bin/env bash
# One device call (repo root there; carry dist dist_old .whl benchmarks/COMMIT): the split-KV / SDPA-backend check
# (benchmarks/split_kv_gpu_check.py), then benchmarks/dit_step_gpu.py against two wheels on the same warm machine —
# dist_old/ (e.g. `git worktree add /tmp/old 9ee7df3 && pip wheel --no-deps /tmp/old -w dist_old`) and dist/ (the
# working tree's) —, each in its own --target site: the cached-hop DiT step's host and GPU time per step and its mel
# against the whole-history hop. ORDER="old new" by default; SIDE_TIMEOUT_S bounds each side (default 170);
# CASES picks dit_step_gpu.py's cases (batch:prior hops, default 1:1,8:1,8:8).
set -u
: "${OUT:?set OUT}"
source benchmarks/device_setup.sh --install || exit 1
(cd /tmp && timeout 100 python3 "$OLDPWD/benchmarks/split_kv_gpu_check.py") > "$OUT/split_kv_check.md" 2>&1
tail -16 "$OUT/split_kv_check.md"
for side in ${ORDER:-old new}; do
  wheel=dist/*.whl; [ "$side" = old ] && wheel=dist_old/*.whl
  rm -rf "/tmp/site_$side"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site_$side" .whl/*.whl $wheel || exit 1
  echo "## $side ($(basename $wheel))"
  (cd /tmp && PYTHONPATH="/tmp/site_$side" timeout "${SIDE_TIMEOUT_S:-170}" python3 "$OLDPWD/benchmarks/dit_step_gpu.py" \
    "$OUT/dit_step_$side.json" --no-capture-all --cases "${CASES:-1:1,8:1,8:8}") 2>&1 | grep -v Warn | tee "$OUT/dit_step_$side.txt" | tail -5
done
