"""On the GPU machine, before the bench: `SchedulerConfig.ar_process` on CUDA with the tiny model — the same tokens
and audio as one process for four concurrent requests (streams and offline), and the child's start time.

    cd /tmp && python3 /path/to/benchmarks/ar_process_check.py [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run(tts, reqs):
    """All requests submitted at once (from a thread each), then each one's audio, tokens and metrics."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(reqs)) as pool:
        handles = list(pool.map(tts.submit, reqs))
    return [(h.result(timeout=300), h.tokens, h.metrics) for h in handles]


def main() -> None:
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.tts import TTS, make_request

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    exact = dict(dit_max_requests=1, hift_max_batch=1)
    specs = [("Hello there.", 1, False, 40), ("Another one here, streaming.", 2, True, 120),
             ("Third text.", 3, False, 80), ("Fourth, streaming and longer still.", 4, True, 200)]
    out = {}
    results = {}
    for name, on in (("one_process", False), ("ar_process", True)):
        t = time.perf_counter()
        tts = TTS.load("tiny", device=args.device, scheduler=SchedulerConfig(ar_process=on, **exact))
        tts.synthesize("Warm up.", seed=0, force_tokens=8)
        out[f"{name}_start_s"] = round(time.perf_counter() - t, 2)
        reqs = [make_request(text, seed=seed, stream=stream, force_tokens=n) for text, seed, stream, n in specs]
        t = time.perf_counter()
        results[name] = run(tts, reqs)
        out[f"{name}_run_s"] = round(time.perf_counter() - t, 3)
        out[f"{name}_ttfa_ms"] = [round(1e3 * m.ttfa, 1) for _, _, m in results[name]]
        out[f"{name}_ar"] = {k: v for k, v in tts.scheduler.stats()["ar"].items()
                             if k in ("decode_steps", "max_decode_batch", "process_pid", "timed_steps")}
        tts.close()
    a, b = results["one_process"], results["ar_process"]
    out["same_tokens"] = all(x[1] == y[1] for x, y in zip(a, b))
    out["max_abs_diff"] = max(float(np.abs(x[0] - y[0]).max()) if x[0].shape == y[0].shape else float("inf")
                              for x, y in zip(a, b))
    print(json.dumps(out))


if __name__ == "__main__":  # the AR process is spawned: this module is imported again there
    main()
