"""The open-loop cell's kernel profile (tools/bench/kernel_profile.py): the summary of a Chrome trace from
torch.profiler — kernels attributed to the thread that launched them through the correlation id (a CUDA graph
replay's kernels share their cudaGraphLaunch's), the device's busy share as the union of kernel intervals, the
overlap, the top kernels — and the window's life cycle (off without CUDA in the bench; stops with the cell)."""
from __future__ import annotations

import time

import torch

from cosytrt.tools.bench.kernel_profile import KernelProfile, _union_us, summarize_trace
from cosytrt.tools.bench.open_loop import _kernel_line, _slug
from cosytrt.tools.bench.report import _kernel_row


def _launch(tid, corr, name="cudaLaunchKernel", cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": 0, "dur": 1, "args": {"correlation": corr}}


def _kernel(ts, dur, corr, stream, name, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": stream}}


def test_union_of_intervals():
    assert _union_us([]) == 0
    assert _union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_summary_attributes_kernels_to_launching_threads():
    trace = {"traceEvents": [
        _launch(101, 1, "cudaGraphLaunch"),                    # AR: one graph replay, two kernels
        _kernel(0, 40, 1, 7, "gemv_decode"), _kernel(40, 20, 1, 7, "sample_topk"),
        _launch(202, 2, "cuLaunchKernel", cat="cuda_driver"),  # DiT, on its stream, overlapping the AR's
        _kernel(30, 50, 2, 9, "attention_dit"),
        _kernel(90, 10, 3, 9, "Memcpy DtoH", cat="gpu_memcpy"),  # its launch was not recorded
        {"ph": "M", "name": "thread_name", "tid": 101, "args": {"name": "x"}},  # metadata: ignored
    ]}
    s = summarize_trace(trace, {101: "cosytrt-ar", 202: "cosytrt-dit"}, window_s=200e-6)
    assert s["kernels"] == 4 and s["window_s"] == 0.0002
    # busy: [0, 80) and [90, 100) = 90 of 200 us; summed kernel time 120 us
    assert s["device_busy"] == 0.45 and s["concurrency"] == round(120 / 90, 3) and s["kernel_ms"] == 0.12
    assert list(s["threads"]) == ["cosytrt-ar", "cosytrt-dit", "unattributed"]  # heaviest first
    ar = s["threads"]["cosytrt-ar"]
    assert ar["kernels"] == 2 and ar["busy"] == 0.3 and ar["top"] == ["gemv_decode", "sample_topk"]
    assert s["threads"]["unattributed"]["top"] == ["[gpu_memcpy] Memcpy DtoH"]
    assert set(s["streams"]) == {"7", "9"} and s["streams"]["9"]["kernels"] == 2
    top = s["top_kernels"][0]
    assert top == {"name": "attention_dit", "count": 1, "ms": 0.05, "mean_us": 50.0, "threads": ["cosytrt-dit"]}
    # no window given: first kernel start to last kernel end
    assert summarize_trace(trace, {})["window_s"] == 0.0001
    assert summarize_trace({"traceEvents": []}) == {"kernels": 0}
    # what the log and the report print of it
    line = _kernel_line(s)
    assert "device busy 45 %" in line and "cosytrt-ar 30 %" in line
    row = _kernel_row(s)
    assert row[2] == "45 %" and "cosytrt-dit 25 % (attention_dit)" in row[4] and row[5].startswith("attention_dit")
    assert _kernel_line({"error": "RuntimeError: x"}) == "failed: RuntimeError: x"
    assert _kernel_line({"kernels": 0}) == "no kernels recorded"


def test_window_lifecycle_on_cpu(tmp_path):
    """Off: nothing runs. On (here without a GPU): the window starts from a helper thread, ends with the cell even
    when the cell is shorter than the window, and leaves a summary (no kernels on the CPU) or the error — never an
    exception in the cell; the trace file is kept when asked."""
    with KernelProfile(False) as kp:
        pass
    assert kp.summary() is None
    t0 = time.perf_counter()
    trace = tmp_path / "t.json.gz"
    with KernelProfile(True, start_s=0.0, window_s=30.0, trace_path=str(trace)) as kp:
        time.sleep(0.2)
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert time.perf_counter() - t0 < 25  # stopped with the cell, not after the 30 s window
    s = kp.summary()
    assert s is not None and ("error" in s or s.get("kernels") == 0)
    if "error" not in s:
        assert trace.is_file()
    assert _slug("ar_graph_sampling=1+x y") == "ar_graph_sampling_1_x_y" and _slug("") == "default"


def test_window_digest_names_the_launching_worker(monkeypatch, tmp_path):
    """The whole window with a stand-in profiler (the CUDA path cannot run here): the trace it exports is read after
    the cell, kernels are attributed to the worker thread (by its native id, named as the scheduler names its
    threads) whose launch they correlate with, and the trace is kept gzipped when asked."""
    import gzip
    import json
    import threading

    import torch.profiler as tp

    ready, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (ready.set(), stop.wait(10)), name="cosytrt-dit", daemon=True)
    worker.start()
    ready.wait(5)
    trace = {"traceEvents": [_launch(worker.native_id, 7, "cudaGraphLaunch"), _kernel(0, 30, 7, 3, "dit_gemm"),
                             _kernel(30, 10, 7, 3, "dit_softmax")]}

    class FakeProfile:
        def __init__(self, activities=None):
            self.entered = self.exited = False

        def __enter__(self):
            self.entered = True
            return self

        def __exit__(self, *exc):
            self.exited = True

        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump(trace, f)

    monkeypatch.setattr(tp, "profile", FakeProfile)
    kept = tmp_path / "trace.json.gz"
    try:
        with KernelProfile(True, start_s=0.0, window_s=0.05, trace_path=str(kept)) as kp:
            time.sleep(0.3)
    finally:
        stop.set()
    s = kp.summary()
    assert s["kernels"] == 2 and list(s["threads"]) == ["cosytrt-dit"]
    assert s["threads"]["cosytrt-dit"]["top"] == ["dit_gemm", "dit_softmax"]
    with gzip.open(kept) as f:
        assert json.load(f) == trace


def test_thread_names_cover_native_and_pthread_ids():
    """A trace's tid may be a thread's native id or (run 47) the low 32 bits of its pthread id, signed or not: each
    maps to the thread's name."""
    from types import SimpleNamespace

    from cosytrt.tools.bench.kernel_profile import thread_names

    t = SimpleNamespace(native_id=4242, ident=0x7F3A_E130_1640, name="cosytrt-ar")
    names = thread_names([t, SimpleNamespace(native_id=None, ident=None, name="x")])
    assert names[4242] == names[0x7F3AE1301640] == names[0xE1301640] == names[0xE1301640 - (1 << 32)] == "cosytrt-ar"
    assert len(names) == 4
