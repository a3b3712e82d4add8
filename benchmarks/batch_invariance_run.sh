#!/usr/bin/env bash
# Issue #20 on the lent GPU machine, one command from the repo root there (see benchmarks/batch_invariance_gpu.py):
#   bash benchmarks/batch_invariance_run.sh --parts step,logits        # ~3-4 min: AR step cost + logits invariance
#   bash benchmarks/batch_invariance_run.sh                            # + 16 concurrent requests (needs .whl/)
# Writes $OUT/batch_invariance.json (results + `summary` + `status`), $OUT/batch_invariance.md and $OUT/log.txt.
# The carried frontend wheels (.whl/: soxr, soundfile, kaldi-native-fbank; only the `tokens` part needs them) are
# installed next to the machine's own torch when present. The script skips parts that would start after
# BI_BUDGET_S (default 420 s) and is stopped after BI_TIMEOUT_S (default 570 s), inside a device call's 600 s; the
# JSON is rewritten after every part, so what ran comes back either way.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>/dev/null | tee "$OUT/gpu.txt"
timeout "${BI_TIMEOUT_S:-570}" python3 -X faulthandler benchmarks/batch_invariance_gpu.py "$OUT" \
  --budget-s "${BI_BUDGET_S:-420}" "$@" 2>&1 | tee "$OUT/log.txt"
exit "${PIPESTATUS[0]}"
