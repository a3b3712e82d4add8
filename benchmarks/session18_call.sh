#!/usr/bin/env bash
# The next session's device calls (BENCHMARKS.md, runs 47-48, "Next GPU session"), as jobs of one bench process that
# stays up between calls (bench_job.sh: only the first call pays the 5-6 minute set-up). The compiled variant under
# open-loop traffic; every cell with a 1 s kernel profile (its launching threads now named) and the stack sampler
# (where each worker thread's host time goes: run 47 found the GPU idle 55 % of an 8 req/s window).
#   CALL=mixed (first): mixed lengths at 8 and 12 req/s, 24 s of arrivals and 8 s of drain (AR pacing defers long
#     streams' finals: a longer cell than run 48's), today's defaults against AR pacing (lead 2 s), the 0.5 ms
#     interpreter switch interval and in-graph sampling (now with the event read-back); two calls' worth;
#   CALL=long: 40 s streams at 1 / 2 / 3 req/s, defaults against AR pacing (the 40 s saturation target;
#     their finals, ~2150 frames, are longer than h200-graphs' largest DiT offline bucket, 1536: they run eager and
#     show as eager fallbacks — h200-mixed covers them, 16 x 2168, but needs its own process: START_ARGS=
#     "--graph-profile h200-mixed" on a fresh machine, not yet run on a GPU);
#   CALL=offline: the same 40 s mix offline (the "within 1.5x of offline" half of that target);
#   CALL=c1: 1 req/s, in-graph sampling off / on with the event read-back (the c1 TTFA target: 28 AR steps of the
#     ~100 ms to first audio; run 45 halved the AR thread's host time per step with it).
#   AB=... replaces the settings. Each call waits up to WAIT_S (default 560 s) for its job; call again with the same
#   CALL to keep waiting. Fire each call within 30 s of the previous one (the machine's idle release).
#   usage (repo root on the device): CALL=mixed bash benchmarks/session18_call.sh
#   carry: dist .whl compile_cache benchmarks/COMMIT (the first call; later calls need only the repo)
set -u
kp=(--kernel-profile-s 1 --sample-stacks --budget-s 100000)
case "${CALL:-mixed}" in
  mixed)   args=(--rates 8,12 --duration-s 24 --drain-s 8
                 --ab "${AB:-ar_graph_sampling=0,ar_pace_lead_s=2,fast_gil_switch=1,ar_graph_sampling=1}") ;;
  long)    args=(--rates 1,2,3 --duration-s 24 --drain-s 8 --lengths 40:0 --stream-fraction 1
                 --ab "${AB:-ar_graph_sampling=0,ar_pace_lead_s=2}") ;;
  offline) args=(--rates 1,2,3,4 --duration-s 24 --drain-s 8 --lengths 40:0 --stream-fraction 0) ;;
  c1)      args=(--rates 1 --duration-s 24 --drain-s 8 --ab "${AB:-ar_graph_sampling=0,ar_graph_sampling=1}") ;;
  *) echo "CALL must be mixed, long, offline or c1"; exit 2 ;;
esac
JOB=${JOB:-${CALL:-mixed}} bash benchmarks/bench_job.sh "${args[@]}" "${kp[@]}"
