"""Prometheus export for /metrics (prometheus_client for the server's own histograms and counters)."""
from __future__ import annotations

import math

from ..scheduling.lock_probe import LockProbe

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 50.0)
HISTOGRAMS = (  # (metric name, RequestMetrics attribute, help, buckets)
    ("cosytrt_t_tokenizer_seconds", "t_tokenizer", "Frontend time (T_tokenizer) per request", TIME_BUCKETS),
    ("cosytrt_t_ar_seconds", "t_ar", "AR LM decode time (T_AR) per request", TIME_BUCKETS),
    ("cosytrt_t_dit_seconds", "t_dit", "Flow / DiT time (T_DiT) per request", TIME_BUCKETS),
    ("cosytrt_t_vocoder_seconds", "t_vocoder", "HiFT vocoder time (T_vocoder) per request", TIME_BUCKETS),
    ("cosytrt_t_queue_seconds", "t_queue", "Queue time (server admission + runtime queue) per request",
     TIME_BUCKETS),
    ("cosytrt_time_to_first_audio_seconds", "ttfa", "Time from submit to the first audio chunk", TIME_BUCKETS),
    ("cosytrt_rtf", "rtf", "Real-time factor (synthesis time / audio duration) per request", RTF_BUCKETS),
)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})  # others: "other"
LOCK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RUNTIME_COUNTERS = (("cosytrt_bucket_hits_total", "bucket_hits", "Engine calls that found an exact bucket"),
                    ("cosytrt_bucket_pads_total", "bucket_pads", "Engine calls padded up to a larger bucket"),
                    ("cosytrt_eager_fallbacks_total", "eager_fallbacks", "Calls that no bucket fit, run eagerly"))


def _labels(**kw) -> str:
    def esc(v):
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in kw.items()) + "}"


def _nested_dicts(d: dict, depth: int = 3):
    yield d
    if depth > 0:
        for v in d.values():
            if isinstance(v, dict):
                yield from _nested_dicts(v, depth - 1)


def runtime_view(stats: dict | None) -> dict:
    """What /metrics takes from `tts.metrics()`: the scheduler's in-flight count and queues, the AR's decode steps /
    rows and holds, and bucket hits / pads / eager fallbacks (explicit `bucket_hits` / `bucket_pads` /
    `eager_fallbacks` keys, a number or {stage: number}, else derived from a ShapeStats summary: pads = bucketed
    calls with padding waste > 1, over its kept samples)."""
    dicts = list(_nested_dicts(stats or {}))
    sched = next((d for d in dicts if "in_flight" in d and isinstance(d.get("queues"), dict)), {})
    shapes = next((d for d in dicts if {"hits", "fallbacks"} <= set(d) and isinstance(d.get("stages"), dict)), None)
    counters = {}
    for key in ("bucket_hits", "bucket_pads", "eager_fallbacks"):
        v = next((d[key] for d in dicts if key in d), None)
        if v is None and shapes is not None:
            v = {}
            for sm, st in shapes["stages"].items():
                if not isinstance(st, dict):
                    continue
                samples = (st.get("waste") or {}).get("samples") or []
                v[sm] = (st.get("hits", 0) if key == "bucket_hits" else st.get("fallbacks", 0)
                         if key == "eager_fallbacks" else sum(1 for w in samples if w > 1 + 1e-9))
        counters[key] = v
    dit = next((d for d in dicts if "frames_computed" in d), {})
    ar = next((d for d in dicts if "decode_steps" in d and "decode_rows" in d), {})
    busy = next((d["busy_s"] for d in dicts if isinstance(d.get("busy_s"), dict)), {})
    host = next((d["host_s"] for d in dicts if isinstance(d.get("host_s"), dict)), {})
    pool = dit.get("flow_cache") if isinstance(dit.get("flow_cache"), dict) else {}
    return {"in_flight": _number(sched.get("in_flight")), "queues": sched.get("queues", {}), "counters": counters,
            "shed": _number(sched.get("shed")), "stream_lag_s": _number(sched.get("stream_lag_s")),
            "dit_frames": {k: _number(dit.get(f"frames_{k}")) for k in ("computed", "reused")},
            "cache_fallbacks": _number(dit.get("cache_fallbacks")), "busy_s": busy,
            "host_s": {(stage, kind): _number(h.get(f"{kind}_s")) for stage, h in host.items() if isinstance(h, dict)
                       for kind in ("wall", "cpu") if _number(h.get(f"{kind}_s")) is not None},
            "ar_steps": {**{k: _number(ar.get(f"decode_{k}")) for k in ("steps", "rows")},
                         **({"multi_step_calls": _number(ar["multi_step_calls"])} if "multi_step_calls" in ar else {})}
            if ar else {},
            "ar_waits_s": {k: _number(ar.get(key)) for k, key in (("pace", "pace_wait_s"),
                                                                   ("first_audio_hold", "first_audio_hold_s"))
                           if key in ar},
            "flow_cache_bytes": {k: _number(pool[key]) for k, key in
                                 (("used", "bytes_used"), ("budget", "budget_bytes"), ("peak", "peak_bytes"))
                                 if key in pool}}


def cuda_memory() -> dict | None:
    """The CUDA caching allocator's view, read at scrape time: reserved / allocated bytes, allocation retries (each
    frees every cached block and retries cudaMalloc) and out-of-memory errors since start. None when this process has
    not initialised CUDA (a CPU server never does here)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    st = torch.cuda.memory_stats()
    return {"reserved": float(torch.cuda.memory_reserved()), "allocated": float(torch.cuda.memory_allocated()),
            "retries": float(st.get("num_alloc_retries", 0)), "ooms": float(st.get("num_ooms", 0))}


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class ServerMetrics:
    """Everything /metrics exposes. Request histograms and counters are prometheus_client metrics in a registry of
    this app's own (fixed memory, O(buckets) per scrape); the runtime's gauges and counters are read from
    `tts.metrics()` at scrape time."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.histograms = {name: Histogram(name, text, buckets=b, registry=self.registry)
                           for name, _, text, b in HISTOGRAMS}
        self.http = Counter("cosytrt_http_requests", "HTTP responses by method, route and status",
                            ["method", "route", "status"], registry=self.registry)
        self.outcomes = Counter("cosytrt_speech_requests", "Admitted speech requests by outcome (ok, error, "
                                "cancelled)", ["outcome"], registry=self.registry)
        for outcome in ("ok", "error", "cancelled"):
            self.outcomes.labels(outcome)
        self.audio_seconds = Counter("cosytrt_audio_seconds", "Seconds of audio synthesized", registry=self.registry)
        self.speech_tokens = Counter("cosytrt_speech_tokens", "Speech tokens generated", registry=self.registry)
        self.ws_events = Counter("cosytrt_ws_session_events", "Websocket session events: opened, refused (session "
                                 "limit), idle_closed, stalled (the client took nothing for --send-timeout-s), "
                                 "cancels (barge-in), sentences", ["event"],
                                 registry=self.registry)
        for event in ("opened", "refused", "idle_closed", "stalled", "cancels", "sentences"):
            self.ws_events.labels(event)
        self.inter_chunk = Histogram("cosytrt_inter_chunk_seconds", "Gap between consecutive audio chunks of a "
                                     "streaming request (a playback stall needs a gap longer than the audio before "
                                     "it)", buckets=TIME_BUCKETS, registry=self.registry)
        self.lock_wait = Histogram("cosytrt_interpreter_lock_wait_seconds", "How late a probe thread wakes from "
                                   "20 ms sleeps: the wait for the Python interpreter lock behind the runtime's "
                                   "threads", buckets=LOCK_BUCKETS,
                                   registry=self.registry)
        self.lock_probe = LockProbe(self.lock_wait.observe)

    def count_http(self, method: str, route: str, status: int) -> None:
        """One response (a method outside HTTP's usual ones counted as "other": a client may send any token as a
        method, and each label value is a series kept for ever)."""
        self.http.labels(method if method in HTTP_METHODS else "other", route, str(int(status))).inc()

    def finish(self, outcome: str, m=None, admission_wait: float = 0.0) -> None:
        self.outcomes.labels(outcome).inc()
        if outcome != "ok" or m is None:
            return
        for name, attr, _, _ in HISTOGRAMS:
            v = getattr(m, attr, None)
            if attr == "t_queue":
                v = (v or 0.0) + admission_wait
            v = _number(v)
            if v is not None:
                self.histograms[name].observe(v)
        self.audio_seconds.inc(max(0.0, float(getattr(m, "audio_seconds", 0.0) or 0.0)))
        self.speech_tokens.inc(max(0, int(getattr(m, "tokens", 0) or 0)))
        for gap in getattr(m, "inter_chunk", None) or ():
            if _number(gap) is not None:
                self.inter_chunk.observe(gap)

    def ws_event(self, event: str) -> None:
        self.ws_events.labels(event).inc()

    def render(self, *, in_flight: int, queued: int, ready: bool, runtime_stats: dict | None,
               ws_sessions: int = 0) -> str:
        from prometheus_client import generate_latest

        lines: list[str] = [generate_latest(self.registry).decode().rstrip("\n")]

        def head(name, kind, text):
            lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])

        view = runtime_view(runtime_stats)
        waiting = sum(int(_number(view["queues"].get(q)) or 0) for q in ("frontend", "ar_waiting"))
        head("cosytrt_requests_in_flight", "gauge", "Speech requests admitted by the server and not finished")
        lines.append(f"cosytrt_requests_in_flight {in_flight}")
        head("cosytrt_queue_depth", "gauge",
             "Requests waiting: for a server slot, plus in the runtime before AR decoding starts")
        lines.append(f"cosytrt_queue_depth {queued + waiting}")
        head("cosytrt_runtime_requests_in_flight", "gauge", "Requests in flight in the runtime scheduler")
        lines.append(f"cosytrt_runtime_requests_in_flight {view['in_flight'] or 0.0!r}")
        head("cosytrt_runtime_queue_depth", "gauge", "Jobs queued per runtime stage")
        for q, n in sorted(view["queues"].items()):
            if _number(n) is not None:
                lines.append(f"cosytrt_runtime_queue_depth{_labels(queue=q)} {_number(n)!r}")
        head("cosytrt_ws_sessions", "gauge", "Open websocket sessions (WS /v1/audio/speech/stream)")
        lines.append(f"cosytrt_ws_sessions {int(ws_sessions)}")
        head("cosytrt_ready", "gauge", "1 once the model is loaded and warmed")
        lines.append(f"cosytrt_ready {int(ready)}")
        for name, key, text in RUNTIME_COUNTERS:
            head(name, "counter", text)
            v = view["counters"][key]
            per_stage = [(k, _number(x)) for k, x in sorted(v.items())] if isinstance(v, dict) else []
            per_stage = [(k, x) for k, x in per_stage if x is not None]
            if per_stage:
                lines.extend(f"{name}{_labels(stage=k)} {x!r}" for k, x in per_stage)
            else:
                lines.append(f"{name} {_number(v) or 0.0!r}")
        head("cosytrt_dit_frames_total", "counter", "DiT mel frames computed, and reused from the flow prefix cache "
             "by streaming hops")
        for k, x in view["dit_frames"].items():
            lines.append(f"cosytrt_dit_frames_total{_labels(kind=k)} {x or 0.0!r}")
        head("cosytrt_flow_cache_fallbacks_total", "counter",
             "Streaming hops the full prefix cache pool could not take new frames from (they reuse what is cached and "
             "commit nothing new, so later hops recompute more)")
        lines.append(f"cosytrt_flow_cache_fallbacks_total {view['cache_fallbacks'] or 0.0!r}")
        if view["flow_cache_bytes"]:
            head("cosytrt_flow_cache_bytes", "gauge", "Flow prefix cache pool: bytes in use, its budget, the peak "
                 "in use since start (about 1.8 MB per streamed mel frame at full size)")
            for k, x in sorted(view["flow_cache_bytes"].items()):
                if x is not None:
                    lines.append(f"cosytrt_flow_cache_bytes{_labels(kind=k)} {x!r}")
        mem = cuda_memory()
        if mem is not None:
            head("cosytrt_gpu_memory_bytes", "gauge", "GPU memory of this process's CUDA caching allocator")
            lines.extend(f"cosytrt_gpu_memory_bytes{_labels(kind=k)} {mem[k]!r}" for k in ("reserved", "allocated"))
            head("cosytrt_cuda_alloc_retries_total", "counter", "CUDA allocations retried after freeing every cached "
                 "block (memory pressure: each retry synchronises the device)")
            lines.append(f"cosytrt_cuda_alloc_retries_total {mem['retries']!r}")
            head("cosytrt_cuda_ooms_total", "counter", "CUDA out-of-memory errors (the requests in that call failed)")
            lines.append(f"cosytrt_cuda_ooms_total {mem['ooms']!r}")
        if view["ar_steps"]:
            head("cosytrt_ar_decode_total", "counter", "AR decode steps, the rows they advanced (rows / steps: the "
                 "decode batch) and the runner calls that made several steps each (ar_decode_steps)")
            for k, x in view["ar_steps"].items():
                lines.append(f"cosytrt_ar_decode_total{_labels(kind=k)} {x or 0.0!r}")
        if view["ar_waits_s"]:
            head("cosytrt_ar_wait_seconds_total", "counter", "Seconds the AR held its decode steps: AR pacing (every "
                 "stream far enough ahead of its listener) and first-audio holds")
            for k, x in view["ar_waits_s"].items():
                lines.append(f"cosytrt_ar_wait_seconds_total{_labels(kind=k)} {x or 0.0!r}")
        if view["stream_lag_s"] is not None:
            head("cosytrt_stream_lag_seconds", "gauge", "How far the live stream furthest behind its listener is "
                 "(an underrun that deep, or a first audio awaited that long); 0: none behind")
            lines.append(f"cosytrt_stream_lag_seconds {view['stream_lag_s']!r}")
        if view["shed"] is not None:
            head("cosytrt_requests_shed_total", "counter", "Requests refused by load shedding (shed_lag_s: a live "
                 "stream was behind its listener)")
            lines.append(f"cosytrt_requests_shed_total {view['shed']!r}")
        head("cosytrt_stage_busy_seconds_total", "counter", "Seconds each runtime stage spent running batches")
        for k, x in sorted(view["busy_s"].items()):
            if _number(x) is not None:
                lines.append(f"cosytrt_stage_busy_seconds_total{_labels(stage=k)} {_number(x)!r}")
        if view["host_s"]:
            head("cosytrt_stage_host_seconds_total", "counter", "Seconds each stage's worker thread spent inside its "
                 "batches (kind=wall) and its CPU seconds there (kind=cpu); wall - cpu: blocked on the interpreter "
                 "lock or the OS")
            for (stage, kind), x in sorted(view["host_s"].items()):
                lines.append(f"cosytrt_stage_host_seconds_total{_labels(stage=stage, kind=kind)} {x!r}")
        return "\n".join(lines) + "\n"


