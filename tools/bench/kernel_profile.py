"""Where the GPU's time goes inside an open-loop cell: a `torch.profiler` window of CUDA activity, summarised per
launching thread (the scheduler's AR / DiT / HiFT workers are threads named `cosytrt-<stage>`), per stream and per
kernel.

nvidia-smi's utilisation (`gpu_util.py`) says only whether any kernel ran in a period: at 8-12 req/s it reads 93-95 %
(BENCHMARKS.md runs 42-44) and cannot tell a GPU full of work from one that runs three threads' small kernels one
after another. This window measures, from CUPTI's own kernel records:

  * `device_busy`: the share of the window in which at least one kernel ran (the union of all kernel intervals);
  * `concurrency`: summed kernel time / that union (1.0: kernels never overlapped; streams did not help);
  * per launching thread: kernel time as a share of the window, kernels, and its top kernels. A kernel is attributed
    through the `correlation` id that links it to the runtime / driver call that launched it (a CUDA graph replay's
    kernels share its `cudaGraphLaunch`), whose `tid` names the launching thread (its native id, or the low 32
    bits of its pthread id as in run 47's traces: `thread_names` maps both);
  * the top kernels overall (name, count, total ms, mean µs).

The profiler starts `start_s` after the cell starts (default: the middle of the arrival window) for `window_s`
seconds, from a helper thread, so the workers run as they would; CUPTI's kernel records cost some GPU time while it
runs, so a profiled cell's latency figures are marked by its `kernel_profile` entry. The trace is exported and read
after the cell (reading it holds the interpreter lock for seconds). Nothing happens without CUDA. The parsing
works on the Chrome trace that `torch.profiler` exports (the documented format: `traceEvents`, kernels with
`cat` "kernel", launches with `cat` "cuda_runtime" / "cuda_driver", both with `args.correlation`)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import threading
import time

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 12


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (µs)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def thread_names(threads) -> dict[int, str]:
    """Every id a trace may give a Python thread -> its name: the native (kernel) id and the pthread id
    (`Thread.ident`), whole, as its low 32 bits and as their signed value (run 47's traces carried tids such as
    1630533312, the low half of a pthread id, not native ids)."""
    out: dict[int, str] = {}
    for t in threads:
        for i in (t.native_id, t.ident):
            if i is None:
                continue
            low = i & 0xFFFFFFFF
            for k in (i, low, low - (1 << 32) if low >= 1 << 31 else low):
                out.setdefault(k, t.name)
    return out


def summarize_trace(trace: dict, threads: dict[int, str] | None = None, window_s: float | None = None) -> dict:
    """The summary of a Chrome trace from `torch.profiler` (see the module doc). `threads`: trace tid -> name
    (`thread_names`: the launching threads' names; ids not in it show as `tid N`). `window_s`: the profiled wall
    time (default: first kernel start to last kernel end)."""
    threads = threads or {}
    events = trace.get("traceEvents") or []
    launcher: dict[int, int] = {}  # correlation -> launching thread's tid
    gpu = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        corr = (ev.get("args") or {}).get("correlation")
        if cat in LAUNCH_CATEGORIES and corr is not None:
            launcher[corr] = ev.get("tid")
        elif cat in GPU_CATEGORIES:
            gpu.append(ev)
    if not gpu:
        return {"kernels": 0}
    start = min(float(e["ts"]) for e in gpu)
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in gpu)
    window_us = window_s * 1e6 if window_s else max(end - start, 1e-9)
    by_thread: dict[str, dict] = {}
    by_stream: dict[str, dict] = {}
    by_name: dict[str, dict] = {}
    all_iv = []
    for e in gpu:
        s, d = float(e["ts"]), float(e.get("dur", 0))
        args = e.get("args") or {}
        tid = launcher.get(args.get("correlation"))
        who = threads.get(tid, f"tid {tid}") if tid is not None else "unattributed"
        stream = str(args.get("stream", e.get("tid")))
        name = e.get("name", "?") if e.get("cat") == "kernel" else f"[{e.get('cat')}] {e.get('name', '?')}"
        all_iv.append((s, s + d))
        for table, key in ((by_thread, who), (by_stream, stream)):
            row = table.setdefault(key, {"kernels": 0, "us": 0.0, "iv": [], "names": {}})
            row["kernels"] += 1
            row["us"] += d
            row["iv"].append((s, s + d))
            row["names"][name] = row["names"].get(name, 0.0) + d
        k = by_name.setdefault(name, {"count": 0, "us": 0.0, "threads": set()})
        k["count"] += 1
        k["us"] += d
        k["threads"].add(who)
    busy_us = _union_us(all_iv)
    total_us = sum(e - s for s, e in all_iv)

    def rows(table: dict) -> dict:
        return {key: {"kernels": r["kernels"], "ms": round(r["us"] / 1e3, 3),
                      "busy": round(_union_us(r["iv"]) / window_us, 4),
                      "top": [n[:80] for n, _ in sorted(r["names"].items(), key=lambda kv: -kv[1])[:3]]}
                for key, r in sorted(table.items(), key=lambda kv: -kv[1]["us"])}

    return {"kernels": len(gpu), "window_s": round(window_us / 1e6, 4),
            "device_busy": round(busy_us / window_us, 4),
            "concurrency": round(total_us / busy_us, 3) if busy_us else None,
            "kernel_ms": round(total_us / 1e3, 3),
            "threads": rows(by_thread), "streams": rows(by_stream),
            "top_kernels": [{"name": n[:120], "count": k["count"], "ms": round(k["us"] / 1e3, 3),
                             "mean_us": round(k["us"] / k["count"], 2), "threads": sorted(k["threads"])}
                            for n, k in sorted(by_name.items(), key=lambda kv: -kv[1]["us"])[:TOP]]}


def exported_trace(prof, keep_gz: str | None = None) -> dict:
    """The Chrome trace of a stopped `torch.profiler.profile` as a dict (through a temporary file: the profiler only
    exports to a path); `keep_gz`: also keep it there, gzipped."""
    with tempfile.TemporaryDirectory(prefix="cosytrt-kprof-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
        if keep_gz:
            with open(path, "rb") as src, gzip.open(keep_gz, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return trace


class KernelProfile:
    """`with KernelProfile(enabled, start_s, window_s, trace_path) as kp: ...` then `kp.summary()` (None when it
    did not run). `trace_path`: also keep the trace there, gzipped."""

    def __init__(self, enabled: bool, start_s: float = 0.0, window_s: float = 1.0, trace_path: str | None = None):
        self.enabled = bool(enabled) and window_s > 0
        self.start_s, self.window_s, self.trace_path = max(0.0, start_s), window_s, trace_path
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._summary: dict | None = None
        self._prof = None      # the stopped profiler, digested in __exit__
        self._names: dict[int, str] = {}
        self._wall = 0.0
        self.error: str | None = None

    def _run(self) -> None:
        """The window, in the helper thread (the profiler is stopped by the thread that started it)."""
        if self._stop.wait(self.start_s):
            return
        try:
            from torch.profiler import ProfilerActivity, profile

            self._names = thread_names(threading.enumerate())
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
            t0 = time.perf_counter()
            try:
                self._stop.wait(self.window_s)
            finally:
                prof.__exit__(None, None, None)
            self._wall = time.perf_counter() - t0
            self._prof = prof
        except Exception as e:  # noqa: BLE001 - a profiler failure must not fail the cell
            self.error = f"{type(e).__name__}: {e}"

    def _digest(self) -> None:
        """Export and summarise the window's trace: after the cell (`__exit__`), since writing and reading a trace
        of ~10^5 kernels holds the interpreter lock for seconds that the workers would lose mid-cell."""
        prof, self._prof = self._prof, None
        try:
            self._summary = summarize_trace(exported_trace(prof, self.trace_path), self._names, self._wall)
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"

    def __enter__(self) -> "KernelProfile":
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="cosytrt-bench-kernel-profile", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=120)
            self._thread = None
        if self._prof is not None:
            self._digest()

    def summary(self) -> dict | None:
        if self.error:
            return {"error": self.error}
        return self._summary
