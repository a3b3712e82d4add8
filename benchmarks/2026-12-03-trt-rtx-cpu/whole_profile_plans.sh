#!/bin/bash
# one plan per (profile, stage/mode), every bucket of the profile: what `trtbuild build` writes
cd "$(git rev-parse --show-toplevel)"  # the worktree (/work/wt/rtx7 on the day)
export PYTHONPATH=/tmp/rtx:.shim PYTHONUNBUFFERED=1
T="python3 -m cosytrt.tools.trtbuild build --model random-full --backend tensorrt --device cpu --onnx-dir /tmp/rtx7/onnx --quiet --json"
for p in default h200-graphs; do
  echo "== $p hift $(date -u +%T)"; /usr/bin/time -v $T --profile $p --stages hift --out /tmp/rtx7/sets/${p}_hift > /tmp/rtx7/sets/${p}_hift.json 2> /tmp/rtx7/sets/${p}_hift.err; echo "rc=$?"
done
for p in default h200-graphs; do
  echo "== $p dit stream fp32 $(date -u +%T)"; /usr/bin/time -v $T --profile benchmarks/2026-12-03-trt-rtx-cpu/${p}_dit_stream_fp32.yaml --out /tmp/rtx7/sets/${p}_dit_stream_fp32 > /tmp/rtx7/sets/${p}_dit.json 2> /tmp/rtx7/sets/${p}_dit.err; echo "rc=$?"
done
echo "== done $(date -u +%T)"
