#!/usr/bin/env bash
# The next session's device calls (BENCHMARKS.md, runs 50-54, "Next GPU session"), as jobs of one bench process that
# stays up between calls (bench_job.sh: only the first call pays the 5-6 minute set-up; one job per call: a call
# brings back at most 8 files). The compiled variant under open-loop traffic, each cell with the worker threads'
# host seconds (`StageClock.host_s`: the AR's wall / CPU ms per step and the share of it blocked — the interpreter
# lock — new since run 53) and a 1 s kernel profile. What is asked: does multi-step AR decode (`ar_decode_steps`,
# new, K steps per runner call) lift the AR-bound cells? Run 50-53 found the AR 87-99 % busy where the traffic
# saturated (12 req/s mixed, 40 s streams at 2 req/s, 40 s offline at 3 req/s) with 4-8 ms per step of which ~1 ms
# is kernels. Its first setting captures the multi-step graphs (about K x the 35 s of the sampled graph set; kept
# for later settings with the same K).
#   CALL=mixed (first): mixed lengths at 8 and 12 req/s, 24 s of arrivals and 8 s of drain: defaults against 4
#     steps per call;
#   CALL=long: 40 s streams at 1 / 2 / 3 req/s, defaults against 4 steps per call (the 40 s saturation target);
#   CALL=offline: the same 40 s mix offline, the same two settings (the "within 1.5x of offline" half);
#   CALL=c1: 1 req/s, defaults against 4 steps per call (a token reaches the DiT up to 3 steps later, each step
#     cheaper: the c1 TTFA target), and with the first-audio hold (the first DiT job took 33 ms in run 52 against
#     ~18 ms of DiT steps alone in run 5: the AR's kernels beside it?);
#   CALL=mixed8: the mixed cells with 8 steps per call (its graphs' capture: another ~2-3 minutes), if time is left;
#   CALL=shed: load shedding past saturation (12 and 16 req/s mixed): defaults against shed_lag_s 1 and 0.5 (new:
#     refuse new requests while a live stream is that far behind its listener; the cells count shed requests apart);
#   CALL=arstep: the AR step alone (tools/bench/ar_step, tiny LM in its CUDA graphs) with and without a thread
#     contending for the interpreter lock (--gil-load 1): single steps, in-graph sampling, 4 steps per call — run it
#     before CALL=mixed starts the bench process or after the last job (never beside the process's cells);
#   CALL=hift: the vocoder on its own stream (hift_own_stream; runs 42 and 44 at 8 req/s only) at 8 / 12
#     req/s: in run 51 the AR thread sat idle 8-12 % of the 12 req/s cell while first hops waited 2.8 s (p95) for
#     the DiT, whose thread waited for its GPU work 45 % of the time — and the HiFT's fp32 convolutions run on that
#     same stream, between the DiT's steps.
#   CALL=attn: the compiled full-size LM's step alone (tools/bench/ar_step --model full --compile) with the fused
#     SDPA decode attention against the split-KV Triton kernels (ar_decode_attention, new in session 20) — before
#     CALL=mixed starts the bench process (the GPU memory); a cold compile of the LM took over 200 s in run 57, so
#     each implementation gets up to 290 s: IMPLS="split_kv" in a second call if the first ran out; GPU_LOAD=0.5: the
#     same beside a thread keeping the GPU half busy with DiT-sized GEMMs (ar_step --gpu-load: the AR's cost of
#     sharing the GPU, apart from the lock's); it first runs benchmarks/split_kv_gpu_check.py (the kernels' values
#     and µs per layer against SDPA, ~30 s); COMPILE=0: the LM uncompiled in its CUDA graphs (seconds, not minutes:
#     run 61's form);
#   CALL=quick: benchmarks/dit_conv_check.py, benchmarks/gather_width_check.py, benchmarks/hop_attention_tiles.py
#     (the paged prefix attention per tile) and benchmarks/green_ctx_probe.py (the AR step beside a DiT-sized load,
#     the load in an SM partition or not); no compile, ~3 minutes;
#   CALL=checks: benchmarks/dit_step_gpu.py --compile (the compiled cached-hop step: per-layer K/V inputs against the
#     paged prefix and the Triton conv, sessions 24-25), benchmarks/dit_conv_check.py (the DiT's grouped conv per implementation),
#     benchmarks/split_kv_gpu_check.py (the split-KV kernels' values and µs, table 3: the in-place slot
#     read against the gathered copy) and benchmarks/hift_tf32_check.py (the vocoder's wav and ms with TF32 against
#     fp32) — before CALL=mixed starts the bench process;
#   AB=... replaces the settings, RATES=... the rates (e.g. RATES=12), DRAIN=... the drain's seconds (default 8, CALL=long
#   42: 40 s streams need ~40 for every stream's audio to be delivered inside the cell: the slack-first DiT defers a
#   stream's final until its listener nears it, so a short drain leaves streams unfinished though ahead). Each call waits up to WAIT_S (default 560 s)
#   for its job; call again with the same CALL to keep waiting. Fire each call within 30 s of the previous one (the
#   machine's idle release).
#   usage (repo root on the device): CALL=mixed bash benchmarks/session19_call.sh
#   carry: dist .whl compile_cache benchmarks/COMMIT (the first call; later calls need only the repo)
set -u
if [ "${CALL:-}" = arstep ]; then
  source benchmarks/device_setup.sh --install || exit 1
  for load in 0 1; do
    (cd /tmp && python3 -m cosytrt.tools.bench.ar_step --device cuda --batches 1,8,32 --steps 100 --repeats 3 \
      --gil-load $load) 2>&1 | tail -6 | tee -a "$OUT/ar_step.md"
  done
  exit 0
fi
if [ "${CALL:-}" = quick ]; then  # no compile, ~1 minute: the DiT conv per implementation and the gather width
  source benchmarks/device_setup.sh --install || exit 1
  (cd /tmp && timeout 90 python3 "$OLDPWD/benchmarks/dit_conv_check.py") > "$OUT/dit_conv.md" 2>&1
  grep "^|" "$OUT/dit_conv.md"
  (cd /tmp && timeout 60 python3 "$OLDPWD/benchmarks/gather_width_check.py") > "$OUT/gather_width.md" 2>&1
  grep "^|" "$OUT/gather_width.md"
  # the paged prefix attention per tile against the gathered form (session 26: run 66's kernel was 3.8 ms of an
  # 8.5 ms compiled step at 8 x 200 over 1500)
  (cd /tmp && timeout 120 python3 "$OLDPWD/benchmarks/hop_attention_tiles.py" "$OUT/hop_tiles.md") > "$OUT/hop_tiles.txt" 2>&1
  tail -8 "$OUT/hop_tiles.txt"
  # an SM partition for the DiT-sized work (CUDA green contexts) against the AR step's wait beside it (session 26)
  (cd /tmp && timeout 120 python3 "$OLDPWD/benchmarks/green_ctx_probe.py" "$OUT/green_ctx.md") > "$OUT/green_ctx.txt" 2>&1
  tail -8 "$OUT/green_ctx.txt"
  exit 0
fi
if [ "${CALL:-}" = checks ]; then  # before the bench process: the kernels' and the vocoder's checks, ~5-9 minutes
  source benchmarks/device_setup.sh --install || exit 1
  # the compiled cached-hop step (the paged prefix, the CUDA default since run 66) with the DiT's grouped conv as
  # the default traces it (F.conv1d: 1.1 of 2.2 ms per step at one request in run 66, cuDNN's "analytic" kernel in
  # 16 launches per conv) against the opaque op running the channels-last cuDNN conv or the Triton kernel (session
  # 26); each form its own compile (~155 s): ms per step, mel across forms and against the whole-history hop, top
  # kernels (FORMS may add layers / stacked: the gathered forms; +narrow: the 2-byte gather).
  # KERNELS_ONLY=1: stop after these two scripts
  (cd /tmp && timeout "${DIT_STEP_S:-420}" python3 "$OLDPWD/benchmarks/dit_step_gpu.py" "$OUT/dit_step.json" --compile \
    --forms "${FORMS:-paged,paged+conv=nhwc,paged+conv=triton}" --cases "${CASES:-1:1,8:8}" \
    --profile --no-capture-all) > "$OUT/dit_step.txt" 2>&1
  grep -v Warn "$OUT/dit_step.txt" | tail -40
  (cd /tmp && timeout 70 python3 "$OLDPWD/benchmarks/dit_conv_check.py") > "$OUT/dit_conv.md" 2>&1
  tail -12 "$OUT/dit_conv.md"
  [ "${KERNELS_ONLY:-0}" = 1 ] && exit 0  # the DiT's step and conv only (run 64 measured the two below)
  (cd /tmp && timeout 120 python3 "$OLDPWD/benchmarks/split_kv_gpu_check.py") > "$OUT/split_kv_check.md" 2>&1
  tail -14 "$OUT/split_kv_check.md"
  (cd /tmp && timeout 150 python3 "$OLDPWD/benchmarks/hift_tf32_check.py") > "$OUT/hift_tf32.md" 2>&1
  tail -8 "$OUT/hift_tf32.md"
  exit 0
fi
if [ "${CALL:-}" = oldlong ]; then
  # #18's 40 s baseline: the wheel of c5f2d40 (carried as dist_old/, built with `git worktree add /tmp/old c5f2d40 &&
  # pip wheel --no-deps /tmp/old -w dist_old`) under HEAD's open-loop cell of CALL=long (the same arrivals: HEAD's
  # generator, seed 0, 40 s streams, 24 s of arrivals, 42 s drain), its compiled variant set up as its own serving
  # bench did (cold: 5-9 minutes), in the background: call again with CALL=oldlong to keep waiting; results in
  # $OUT/old_long.json and old_long.log. Run it beside no other GPU process.
  source benchmarks/device_setup.sh --install || exit 1
  D=/tmp/oldlong; mkdir -p $D
  if [ ! -e $D/started ]; then
    rm -rf /tmp/site_old && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site_old .whl/*.whl dist_old/*.whl || exit 1
    (cd /tmp && python3 -c '
import json, sys
from cosytrt.tools.bench.workload import OpenLoopSpec, generate, parse_lengths
cells = [{"rate": r, "arrivals": [dict(index=a.index, t=a.t, tokens=a.tokens, stream=a.stream, seed=a.seed)
          for a in generate(OpenLoopSpec(r, 24.0, 0, 1.0, parse_lengths("40:0"), 2.0, 40.0))]}
         for r in map(float, sys.argv[1].split(","))]
json.dump(cells, open(sys.argv[2], "w"))' "${RATES:-2,3}" $D/arrivals.json) || exit 1
    repo=$(pwd); touch $D/started
    (cd /tmp && PYTHONPATH=/tmp/site_old setsid nohup python3 -X faulthandler "$repo/benchmarks/old_open_loop.py" \
      $D/arrivals.json $D/old_long.json --drain-s "${DRAIN:-42}" < /dev/null > $D/old_long.log 2>&1 &)
  fi
  start=$(date +%s)
  while [ ! -s $D/old_long.json ] && pgrep -f "old_open_loop.p[y]" > /dev/null \
      && [ $(( $(date +%s) - start )) -lt "${WAIT_S:-540}" ]; do sleep 5; done
  cp $D/old_long.log "$OUT/old_long.log"; [ -s $D/old_long.json ] && gzip -c $D/old_long.json > "$OUT/old_long.json.gz"
  grep -v Warn $D/old_long.log | tail -20 | cut -c1-900
  exit 0
fi
if [ "${CALL:-}" = attn ]; then
  source benchmarks/device_setup.sh --install || exit 1
  (cd /tmp && timeout 120 python3 "$OLDPWD/benchmarks/split_kv_gpu_check.py") 2>&1 | tee "$OUT/split_kv_check.md" | tail -14
  compile=--compile; [ "${COMPILE:-1}" = 0 ] && compile=
  for impl in ${IMPLS:-sdpa split_kv}; do
    (cd /tmp && timeout 290 python3 -m cosytrt.tools.bench.ar_step --device cuda --model full $compile \
      --batches "${BATCHES:-1,16}" --steps 100 --repeats 3 --decode-attention $impl \
      --gpu-load "${GPU_LOAD:-0}") 2>&1 | grep -v Warn \
      | tail -7 | tee -a "$OUT/ar_step_attn.md"
  done
  exit 0
fi
kp=(--kernel-profile-s 1 --budget-s 100000)
case "${CALL:-mixed}" in
  mixed)   args=(--rates "${RATES:-8,12}" --duration-s 24 --drain-s "${DRAIN:-8}"
                 --ab "${AB:-ar_decode_steps=1,ar_decode_steps=4}") ;;
  mixed8)  args=(--rates "${RATES:-8,12}" --duration-s 24 --drain-s "${DRAIN:-8}" --ab "${AB:-ar_decode_steps=8}") ;;
  hift)    args=(--rates "${RATES:-8,12}" --duration-s 24 --drain-s "${DRAIN:-8}"
                 --ab "${AB:-hift_own_stream=0,hift_own_stream=1}") ;;
  shed)    args=(--rates "${RATES:-12,16}" --duration-s 24 --drain-s "${DRAIN:-8}"
                 --ab "${AB:-shed_lag_s=0,shed_lag_s=1,shed_lag_s=0.5}") ;;
  long)    args=(--rates "${RATES:-1,2,3}" --duration-s 24 --drain-s "${DRAIN:-42}" --lengths 40:0 --stream-fraction 1
                 --ab "${AB:-ar_decode_steps=1,ar_decode_steps=4}") ;;
  offline) args=(--rates "${RATES:-1,2,3,4}" --duration-s 24 --drain-s "${DRAIN:-8}" --lengths 40:0 --stream-fraction 0
                 --ab "${AB:-ar_decode_steps=1,ar_decode_steps=4}") ;;
  c1)      args=(--rates "${RATES:-1}" --duration-s 24 --drain-s "${DRAIN:-8}"
                 --ab "${AB:-ar_decode_steps=1,ar_decode_steps=4,ar_decode_steps=4+ar_first_audio_hold_ms=30}") ;;
  *) echo "CALL must be mixed, long, offline, c1, mixed8, shed, hift, checks, quick, arstep or attn"; exit 2 ;;
esac
JOB=${JOB:-${CALL:-mixed}} bash benchmarks/bench_job.sh "${args[@]}" "${kp[@]}"
