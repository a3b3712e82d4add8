"""The scheduler's frontend step (`Scheduler._prepare`: text ids, the voice's prompt, LM input) alone and beside
busy Python threads, on the CPU with the tiny model (issue #18: run 31's 'frontend + queue' p95 of 0.13-0.16 s at
4 req/s). Every torch call releases the GIL; with the AR, DiT and HiFT threads of a loaded server wanting it back,
each release costs the frontend thread a wait of up to the switch interval per busy thread. `busy` threads spinning
in pure Python stand in for them (the worst case: they never release it on their own); the switch interval is the
scheduler's (0.5 ms on CUDA, `fast_gil_switch`). Prints one JSON line: ms per step, alone and beside the spinners,
and the torch calls (aten ops) of a saved voice's second request.

    python benchmarks/frontend_gil_cpu.py [--busy 3] [--n 50]
    # before / after in one command: PYTHONPATH=<old checkout's parent with cosytrt> python ... ; then the new one
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy", type=int, default=3, help="spinning Python threads beside the frontend step")
    ap.add_argument("--n", type=int, default=50, help="steps timed per condition")
    ap.add_argument("--switch-interval", type=float, default=0.0005)
    args = ap.parse_args()
    import cosytrt
    from cosytrt.runtime import TTS
    from cosytrt.tools.bench.op_count import OpCounter
    from cosytrt.runtime.scheduling.handle import RequestHandle
    from cosytrt.runtime.scheduling.state import RequestState
    from cosytrt.runtime.stages.request import Request, RequestMetrics

    torch.set_num_threads(1)
    tts = TTS.load("tiny")
    sch = tts.scheduler
    text = "Hello there, how are you doing today, my friend?"

    def state():
        q = Request(text, stream=True)
        return RequestState(q, RequestHandle(q, RequestMetrics(request_id=q.request_id, stream=True), lambda h: None))

    def one():
        r = state()
        t = time.perf_counter()
        sch._prepare(r)
        return time.perf_counter() - t

    for _ in range(5):
        one()
    with OpCounter() as ops:
        one()
    alone = [one() for _ in range(args.n)]
    stop = False

    def spin():
        x = 0
        while not stop:
            x += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval)
    threads = [threading.Thread(target=spin, daemon=True) for _ in range(args.busy)]
    for t in threads:
        t.start()
    try:
        busy = [one() for _ in range(args.n)]
    finally:
        stop = True
        for t in threads:
            t.join()
        sys.setswitchinterval(old)
    tts.close()

    def q(v, p):
        v = sorted(v)
        return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]

    print(json.dumps({"cosytrt": cosytrt.__file__, "torch": torch.__version__, "aten_ops": ops.total,
                      "alone_ms": {"p50": round(statistics.median(alone) * 1e3, 3), "p95": round(q(alone, 95) * 1e3, 3)},
                      "busy_threads": args.busy, "switch_interval_s": args.switch_interval,
                      "busy_ms": {"p50": round(statistics.median(busy) * 1e3, 3), "p95": round(q(busy, 95) * 1e3, 3),
                                  "max": round(max(busy) * 1e3, 3)}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
