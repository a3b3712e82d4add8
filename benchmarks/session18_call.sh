#!/usr/bin/env bash
# The next session's device calls (BENCHMARKS.md, runs 47-48, "Next GPU session"). The compiled variant under
# open-loop traffic; every cell with a 1 s kernel profile (its launching threads now named) and the stack sampler
# (where each worker thread's host time goes: run 47 found the GPU idle 55 % of an 8 req/s window).
#   CALL=mixed (default): mixed lengths at 8 and 12 req/s, 24 s of arrivals and 8 s of drain (AR pacing defers long
#     streams' finals: a longer cell than run 48's), today's defaults against AR pacing (lead 2 s);
#   CALL=long: 40 s streams at 1 / 2 / 3 req/s, defaults against AR pacing (the 40 s saturation target);
#   AB=... replaces the settings.
#   usage (repo root on the device): CALL=mixed bash benchmarks/session18_call.sh
#   carry: dist .whl compile_cache benchmarks/COMMIT
set -u
case "${CALL:-mixed}" in
  mixed) args=(--rates 8,12 --duration-s 24 --drain-s 8) ;;
  long)  args=(--rates 1,2,3 --duration-s 24 --drain-s 8 --lengths 40:0 --stream-fraction 1) ;;
  *) echo "CALL must be mixed or long"; exit 2 ;;
esac
BENCH_TIMEOUT_S=${BENCH_S:-555} bash benchmarks/device_run.sh --suite open_loop --variants compiled "${args[@]}" \
  --budget-s $(( ${BENCH_S:-555} - 30 )) --kernel-profile-s 1 --sample-stacks \
  --ab "${AB:-ar_graph_sampling=0,ar_pace_lead_s=2}"
