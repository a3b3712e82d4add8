# Sourced by device_run.sh and bench_job.sh on the lent GPU machine (repo root): installs the carried wheels (dist/:
# cosytrt, .whl/: soxr, soundfile, kaldi-native-fbank; .whl_serve/ when carried: the server's) into /tmp/site next to
# the machine's own torch, exports PYTHONPATH, restores a carried torch.compile cache (compile_cache/cc.bin.gz.part-*)
# to /tmp/cc.bin and pre-loads any other carried caches (compile_cache_*/) into the machine's on-disk caches; and
# defines hand_back_cache, render_report, bench_alive, follow_bench and pack_job. Installs only when sourced with
# `--install` (else: the functions only).
hand_back_cache() {  # the compile cache the bench process used, in <= 15 MB parts under $OUT/cc (fetched back here)
  if [ -s /tmp/cc.bin ]; then
    mkdir -p "$OUT/cc" && gzip -c /tmp/cc.bin | split -b 15M - "$OUT/cc/cc.bin.gz.part-" && ls -la "$OUT/cc"
  fi
}

render_report() {  # tables and PNGs next to $1/results.json
  if [ -s "$1/results.json" ]; then
    (cd /tmp && python3 -m cosytrt.tools.bench.report "$1/results.json" --out "$1" > "$1/report_log.txt" 2>&1) \
      || echo "report failed (see report_log.txt): render it here with python -m cosytrt.tools.bench.report"
  fi
}

# Found by its command line, not by `$!`: that is setsid's pid, and setsid forks when it leads its process group, so
# the saved pid was gone while the bench process ran on and a second call started a second one beside it (run 50).
bench_alive() {  # is the bench process serving folder $1 (`--keep-alive $1`) running?
  pgrep -f -- "--keep-alive $1 " > /dev/null
}

follow_bench() {  # D START WAIT_S CMD...: print the new lines of D/daemon.log every 2 s until CMD succeeds (returns
  local d=$1 start=$2 wait_s=$3 shown=0 n  # 0), the bench process ends (1) or WAIT_S seconds since START passed (2)
  shift 3
  while :; do
    if [ -f "$d/daemon.log" ]; then
      n=$(wc -l < "$d/daemon.log")
      if [ "$n" -gt "$shown" ]; then sed -n "$((shown + 1)),${n}p" "$d/daemon.log" | grep -v "^\s*$" | cut -c1-600; shown=$n; fi
    fi
    "$@" && return 0
    bench_alive "$d" || return 1
    [ $(( $(date +%s) - start )) -ge "$wait_s" ] && return 2
    sleep 2
  done
}

pack_job() {  # a finished job's folder $1 (results, tables and PNGs rendered next to them) as one archive $2
  local dir=$1 name; name=$(basename "$1")
  [ -f "$dir/bench_tables.md" ] || render_report "$dir"
  tar czf "$2" -C "$(dirname "$dir")" "$name"
}

[ "${1:-}" = "--install" ] || return 0

rm -rf /tmp/site  # a warm machine keeps the last call's install: pip --target would not replace it
# .whl_serve/ (optional, git-ignored): the serve extra's wheels for cp312 (fastapi, uvicorn, websockets, pydantic...)
# that the agent suite's real server needs; fill it with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 -d .whl_serve fastapi uvicorn websockets python-multipart pydantic prometheus-client
serve=(); ls .whl_serve/*.whl >/dev/null 2>&1 && serve=(.whl_serve/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl "${serve[@]}" \
  dist/*.whl || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
if ls compile_cache/cc.bin.gz.part-* >/dev/null 2>&1; then
  if cat compile_cache/cc.bin.gz.part-* | gunzip > /tmp/cc.bin; then echo "restored compile cache: $(du -h /tmp/cc.bin)"
  else echo "compile cache parts incomplete: not used"; rm -f /tmp/cc.bin; fi
fi
# other carried caches (compile_cache_*/cc.bin.gz.part-*: e.g. run 33's of the compiled variant beside the
# graphs_ar one) go into this machine's on-disk Inductor / Triton caches first, in a process of their own (run from
# /tmp: the repo root's cosytrt/ folder would shadow the installed wheel); only
# compile_cache/ is handed back (what the bench's process used, hits included)
for d in compile_cache_*/; do
  ls "$d"cc.bin.gz.part-* >/dev/null 2>&1 || continue
  if cat "$d"cc.bin.gz.part-* | gunzip > /tmp/cc_extra.bin; then
    echo "pre-loaded $d: $(cd /tmp && python3 -c 'import sys; from cosytrt.runtime.stages.compiled import load_compile_cache as l; print(l(sys.argv[1]))' /tmp/cc_extra.bin 2>&1 | tail -1)"
  else echo "compile cache parts of $d incomplete: not used"; fi
  rm -f /tmp/cc_extra.bin
done
