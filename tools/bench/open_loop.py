"""Open-loop serving cells (`trtbuild bench --suite open_loop`): requests arrive as a Poisson process at a rate, for
a duration, with mixed lengths (workload.py), streaming or offline, in the bench's saved-speaker voice; each
listener plays its stream from the first chunk on (playback.py counts underruns and stalls).

A timer thread submits every request at its arrival time (not in waves at t = 0); each chunk's arrival time comes
from its RequestHandle (`metrics.t_submit + metrics.chunk_times`, stamped when the chunk is handed over). After the
arrival window the cell waits up to `drain_s` for the requests in flight, then cancels the rest (`unfinished`).

Sweep: the rates in increasing order until saturation (`playback.saturated`: requests unfinished after the drain,
delivered audio < 0.9 x offered, or TTFA p95 > 5 s). A/B: `ab` names SchedulerConfig boolean fields; each one runs
the sweep with the field off and on, one scheduler per setting over the same pipeline (graphs and compiled code are
shared), one setting after the other. A name that is not a boolean field of this build's SchedulerConfig is skipped
with a message.

Per cell, besides playback.summarize: stage busy fractions (scheduler stats `busy_s`), bucket hits per stage/mode
and eager fallbacks (the engine set's ShapeStats summary, when there is one), DiT frames computed / reused (scheduler
stats `dit.frames_computed` / `dit.frames_reused`, when the runtime reports them), torch.compile graphs compiled
during the cell, peak GPU memory. Scheduler stats are read defensively: a key this build lacks is reported as None.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import torch

from .common import jsonable, log, make_pipeline, random_models, scheduler_config, start_tts
from .gil_probe import GilProbe
from .gpu_util import GpuUtilProbe
from ...runtime.scheduling.admission import OverloadedError
from .playback import (FAILED, NOT_SUBMITTED, OK, SHED, UNFINISHED, RequestRecord, saturated, summarize,
                       wait_or_cancel)
from .workload import Arrival, OpenLoopSpec, generate

TEXT = "a" * 40
OPEN_LOOP_MAX_IN_FLIGHT = 4096  # arrivals are never held back by admission: a backlog shows as latency


def _switch(base, name: str) -> bool:
    """A field the A/B can switch: a bool, or an auto-or-bool one (None by default, e.g. flow_prefix_cache)."""
    v = getattr(base, name)
    field_type = str({f.name: f.type for f in dataclasses.fields(base)}[name])
    return isinstance(v, bool) or (v is None and "bool" in field_type)


def ab_settings(base, flags: list[str]) -> tuple[list[tuple[str, dict]], list[str]]:
    """[(label, SchedulerConfig overrides)] for the A/B over `flags` (each off, then on; settings with the same
    overrides merged), and the messages of the flags skipped. A flag `a+b` switches boolean fields together (off:
    all False, on: all True); a flag `a=0+n=4` is one setting with exactly those values: boolean, numeric or string
    fields (`scheduling.config.config_overrides`, e.g. `dit_max_requests=16`, `max_in_flight=24+on_full=reject`). No
    usable flag: one setting, "default"."""
    from ...runtime.scheduling.config import config_overrides

    fields = {f.name: f for f in dataclasses.fields(base)}
    settings: list[tuple[str, dict]] = []
    skipped = []
    for flag in flags:
        if "=" in flag:  # one setting with explicit values
            try:
                overrides = config_overrides(flag.split("+"), f"--ab {flag}")
                dataclasses.replace(base, **overrides)  # valid together with the bench's own settings
            except Exception as e:  # noqa: BLE001 - InputError naming the item, or the combined config's check
                skipped.append(f"{e}; skipped")
                continue
            settings.append((flag, overrides))
            continue
        names = flag.split("+")
        bad = [n for n in names if n not in fields or not _switch(base, n)]
        if bad:
            skipped.append(f"--ab {flag}: {', '.join(bad)} not a boolean field of SchedulerConfig in this build, "
                           f"skipped")
            continue
        for value in (False, True):
            overrides = {n: value for n in names}
            if all(o != overrides for _, o in settings):
                settings.append((f"{flag} {'on' if value else 'off'}", overrides))
    return settings or [("default", {})], skipped


def scheduler_stats(tts) -> dict:
    try:
        return tts.scheduler.stats() or {}
    except Exception:  # noqa: BLE001 - stats are extras: a runtime without them still runs the cell
        return {}


def _settle(tts, timeout_s: float = 10.0) -> None:
    """Wait (a little) until the work of requests cancelled at the end of a cell has left the stage queues, so that
    it does not run inside the next cell."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        queues = scheduler_stats(tts).get("queues")
        if not isinstance(queues, dict) or not any(v for v in queues.values() if isinstance(v, (int, float))):
            return
        time.sleep(0.05)


def _num(d, *path):
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def _deltas(before: dict, after: dict, section: str, keys) -> dict:
    """after - before of the counters `keys` under stats[section]; None where `after` has no such number."""
    out = {}
    for k in keys:
        a, b = _num(after, section, k), _num(before, section, k)
        out[k] = None if a is None else a - (b or 0)
    return out


def stats_delta(before: dict, after: dict, wall_s: float) -> dict:
    """The cell's share of cumulative scheduler stats: busy fraction per stage, bucket hits / fallbacks per
    stage/mode (ShapeStats summary), eager fallbacks with their reasons, DiT frames computed / reused."""
    busy_b, busy_a = before.get("busy_s") or {}, after.get("busy_s") or {}
    busy = {s: (busy_a[s] - busy_b.get(s, 0.0)) / wall_s for s in sorted(busy_a)} if wall_s > 0 else {}
    buckets, reasons = {}, {}
    sa, sb = (after.get("shapes") or {}).get("stages") or {}, (before.get("shapes") or {}).get("stages") or {}
    for sm, st in sorted(sa.items()):
        prev = sb.get(sm) or {}
        calls = st.get("calls", 0) - prev.get("calls", 0)
        hits = st.get("hits", 0) - prev.get("hits", 0)
        if calls:
            buckets[sm] = {"calls": calls, "hits": hits, "fallbacks": calls - hits, "hit_rate": hits / calls}
        for r, n in (st.get("fallback_reasons") or {}).items():
            d = n - (prev.get("fallback_reasons") or {}).get(r, 0)
            if d:
                reasons[f"{sm}: {r}"] = d
    fb_before = {(f["stage_mode"], f["b"], f["n"]): f["count"]
                 for f in (before.get("shapes") or {}).get("fallback_shapes") or []}
    fallback_shapes = {}  # "stage/mode b,n" -> eager calls in the cell: the shapes a profile should add
    for f in (after.get("shapes") or {}).get("fallback_shapes") or []:
        d = f["count"] - fb_before.get((f["stage_mode"], f["b"], f["n"]), 0)
        if d:
            fallback_shapes[f"{f['stage_mode']} {f['b']},{f['n']}"] = d
    frames = _deltas(before, after, "dit", ("frames_computed", "frames_reused", "cache_fallbacks"))
    kinds = {}  # DiT calls and rows per kind of call (cached / stream / offline, "/step": one Euler step a call)
    ka, kb = (after.get("dit") or {}).get("kinds") or {}, (before.get("dit") or {}).get("kinds") or {}
    for k, v in sorted(ka.items()):
        calls = v.get("calls", 0) - (kb.get(k) or {}).get("calls", 0)
        rows = v.get("rows", 0) - (kb.get(k) or {}).get("rows", 0)
        if calls:
            kinds[k] = {"calls": calls, "rows": rows, "rows_per_call": rows / calls}
    # the AR worker's decode steps: rows per step, the share sampled inside the decode graphs, first-audio holds,
    # pacing waits
    ar = _deltas(before, after, "ar", ("decode_steps", "decode_rows", "prefill_calls", "decode_graph_replays",
                                       "sampled_graph_replays", "first_audio_hold_s", "pace_wait_s",
                                       "multi_step_calls", "timed_steps", "timed_launch_s", "timed_gpu_s",
                                       "timed_rest_s"))
    if ar.get("timed_steps"):  # the timed steps' anatomy, ms per step (stage_clock.StepTimer)
        n = ar["timed_steps"]
        ar["anatomy_ms"] = {k: 1e3 * (ar[f"timed_{k}_s"] or 0.0) / n for k in ("launch", "gpu", "rest")}
    if ar.get("decode_steps"):
        ar["rows_per_step"] = (ar["decode_rows"] or 0) / ar["decode_steps"]
        ar["sampled_share"] = None if ar["sampled_graph_replays"] is None else \
            ar["sampled_graph_replays"] / ar["decode_steps"]
    return {"busy": busy, "host": host_delta(before, after, wall_s, ar.get("decode_steps")),
            "waits": waits_delta(before, after, wall_s),
            "buckets": buckets if sa else None, "ar_steps": ar,
            "fallbacks": sum(b["fallbacks"] for b in buckets.values()) if sa else None,
            "fallback_reasons": reasons, "fallback_shapes": fallback_shapes, "dit_frames": frames, "dit_calls": kinds,
            "cached_hops": cached_hops_delta(before, after), "prefix_pool": prefix_pool_delta(before, after)}


def prefix_pool_delta(before: dict, after: dict) -> dict | None:
    """The flow prefix pool in a cell: hops planned against it and those that fell back (their commit did not fit the
    budget: they recompute past their request's stalled prefix at every later hop), and the pool's peak bytes so far
    (a peak has no per-cell delta) against its budget. None without a pool."""
    fa = (after.get("dit") or {}).get("flow_cache") or {}
    if not fa:
        return None
    fb = (before.get("dit") or {}).get("flow_cache") or {}
    out = {k: (fa.get(k) or 0) - (fb.get(k) or 0) for k in ("cached_hops", "fallback_hops", "whole_hops")}
    out.update(peak_bytes=fa.get("peak_bytes"), budget_bytes=fa.get("budget_bytes"))
    return out


def _time_deltas(before: dict, after: dict, key: str):
    """(name, entry after, entry before, wall s, CPU s) for each entry of the `key` dict of two stats snapshots
    (`host_s` or `waits_s`: name -> {wall_s, cpu_s, ...}) that grew in wall time between them, in name order."""
    a, b = after.get(key) or {}, before.get(key) or {}
    for name, h in sorted(a.items()):
        prev = b.get(name) or {}
        wall = h.get("wall_s", 0.0) - prev.get("wall_s", 0.0)
        if wall > 0:
            yield name, h, prev, wall, h.get("cpu_s", 0.0) - prev.get("cpu_s", 0.0)


def host_delta(before: dict, after: dict, wall_s: float, decode_steps: int | None) -> dict:
    """Per stage, the cell's host side of its spans (`StageClock.host_s`): wall and CPU seconds as shares of the cell,
    the blocked share of the span time (wall - CPU: the interpreter lock or the OS), and for the AR the wall and CPU
    milliseconds per decode step."""
    out = {}
    if wall_s <= 0:
        return out
    for stage, _, _, wall, cpu in _time_deltas(before, after, "host_s"):
        row = {"wall_share": wall / wall_s, "cpu_share": cpu / wall_s, "blocked": max(0.0, wall - cpu) / wall}
        if stage == "ar" and decode_steps:
            row.update(wall_ms_per_step=wall / decode_steps * 1e3, cpu_ms_per_step=cpu / decode_steps * 1e3)
        out[stage] = row
    return out


def waits_delta(before: dict, after: dict, wall_s: float) -> dict:
    """Per wait of the worker threads outside their spans (`StageClock.wait`: dit_fence, dit_idle, hift_idle): its
    wall seconds as a share of the cell, its CPU share (a CUDA wait spins) and how many waits."""
    if wall_s <= 0:
        return {}
    return {name: {"wall_share": wall / wall_s, "cpu_share": cpu / wall_s,
                   "count": w.get("count", 0) - prev.get("count", 0)}
            for name, w, prev, wall, cpu in _time_deltas(before, after, "waits_s")}


def _waits_line(waits: dict | None) -> str:
    """The log line's part for the threads' waits outside their spans (shares of the cell)."""
    if not waits:
        return ""
    return "; waits " + ", ".join(f"{k} {v['wall_share']:.2f}" for k, v in waits.items())


def _host_line(host: dict | None, multi_step_calls: int | None) -> str:
    """The log line's host part: the AR's wall / CPU ms per decode step and each stage's blocked share."""
    if not host:
        return ""
    ar = host.get("ar") or {}
    out = (f"; AR host {ar['wall_ms_per_step']:.2f} ms/step (CPU {ar['cpu_ms_per_step']:.2f})"
           if "wall_ms_per_step" in ar else "")
    if multi_step_calls:
        out += f", {multi_step_calls} multi-step calls"
    return out + "; blocked in spans " + ", ".join(f"{k} {100 * v['blocked']:.0f} %" for k, v in host.items())


def _anatomy_line(ar: dict | None) -> str:
    """The log line's AR step anatomy (`stage_clock.StepTimer`): ms per timed step."""
    a = (ar or {}).get("anatomy_ms")
    if not a:
        return ""
    return (f"; AR step (every 8th): runner call {a['launch']:.2f} ms, its GPU span {a['gpu']:.2f} ms, after it "
            f"{a['rest']:.2f} ms")


def _hop_graphs(stats: dict) -> dict:
    """The cached-hop graphs' counters in `Scheduler.stats()`: under dit.flow_cache (SchedulerStats.to_dict)."""
    fc = (stats.get("dit") or {}).get("flow_cache") or stats.get("flow_cache") or {}
    return fc.get("hop_graphs") or {}


def cached_hops_delta(before: dict, after: dict) -> dict | None:
    """The cell's cached-hop graph calls: hits / misses, calls per shape "b,n,p" (requests, new frames, prefix
    frames; `tools/coverage_profile.derive_cached_grid` takes them) and replays per bucket key."""
    a = _hop_graphs(after) or None
    if not isinstance(a, dict):
        return None
    b = _hop_graphs(before)

    def diff(name: str) -> dict:
        prev = b.get(name) or {}
        return {k: v - prev.get(k, 0) for k, v in (a.get(name) or {}).items() if v - prev.get(k, 0)}

    out = {k: a.get(k, 0) - b.get(k, 0) for k in ("hits", "misses", "capture_failed")}
    out.update(shapes=diff("shapes"), replays=diff("replays"))
    return out


def _record(a: Arrival, h, t0: float, sample_rate: int, error: str | None, cut: bool) -> RequestRecord:
    rec = RequestRecord(a.t, a.audio_s, a.stream)
    if h is None:  # refused at submit: by load shedding (shed_lag_s), or another refusal / error
        rec.status = NOT_SUBMITTED if error is None else SHED if error.startswith(OverloadedError.__name__) else FAILED
        rec.error = error
        return rec
    sizes = []
    try:
        for c in h.chunks(timeout=1.0):
            sizes.append(c.size)
    except Exception as e:  # noqa: BLE001 - failed or cancelled: keep the chunks it delivered
        rec.error = f"{type(e).__name__}: {e}"
    m = h.metrics
    times = list(getattr(m, "chunk_times", None) or [])
    base = getattr(m, "t_submit", None)
    n = min(len(times), len(sizes))
    if base is not None:
        rec.chunk_t = [base + x - t0 for x in times[:n]]
        rec.chunk_s = [s / sample_rate for s in sizes[:n]]
    rec.marks = dict(getattr(m, "marks", None) or {})
    rec.ttfa_s = getattr(m, "ttfa", None)
    if getattr(h, "error", None) is not None or rec.error is not None:
        rec.status = UNFINISHED if cut else FAILED
    else:
        rec.status = OK
    return rec


def drive(tts, arrivals: list[Arrival], duration_s: float, drain_s: float, speaker=None) -> tuple[list, float]:
    """Submit `arrivals` from a timer thread at their times, wait until they finish or until duration_s + drain_s,
    cancel what is left; returns (RequestRecords, end of the cell in seconds after its start)."""
    from ...runtime.models.sampling import SamplingParams
    from ...runtime.stages.request import Request

    handles: list = [None] * len(arrivals)
    errors: list = [None] * len(arrivals)
    stop = threading.Event()
    t0 = time.perf_counter() + 0.02

    def timer():
        for a in arrivals:
            if stop.wait(max(0.0, t0 + a.t - time.perf_counter())):
                return
            req = Request(text=TEXT, stream=a.stream, speaker=speaker,
                          sampling=SamplingParams(seed=a.seed, force_tokens=a.tokens))
            try:
                handles[a.index] = tts.submit(req)
            except Exception as e:  # noqa: BLE001 - a rejected request is a failed request of the cell
                errors[a.index] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=timer, name="cosytrt-bench-arrivals", daemon=True)
    th.start()
    deadline = t0 + duration_s + drain_s
    th.join(max(0.0, deadline - time.perf_counter()))
    stop.set()
    cut = wait_or_cancel(handles, deadline)  # cancelled at the end of the cell
    th.join()
    end = time.perf_counter() - t0
    return [_record(a, handles[a.index], t0, tts.sample_rate, errors[a.index], a.index in cut)
            for a in arrivals], end


def run_open_loop_cell(tts, spec: OpenLoopSpec, drain_s: float, speaker=None, label: str = "",
                       sample_stacks: bool = False, kernel_profile_s: float = 0.0,
                       trace_path: str | None = None) -> dict:
    """One cell: `spec`'s arrivals driven through `tts`, then its playback summary and the scheduler's stats over
    it; `kernel_profile_s` > 0 (CUDA): a profiler window of that length from the middle of the arrivals
    (`kernel_profile.py`; the Chrome trace kept at `trace_path`, gzipped, when given)."""
    from ...runtime.stages.compiled import compiled_graph_count
    from .kernel_profile import KernelProfile
    from .stacks import timed_sampler

    arrivals = generate(spec)
    compiles = compiled_graph_count()
    cuda = torch.cuda.is_available() and getattr(getattr(tts.pipeline, "device", None), "type", "") == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    alloc = allocator_events()
    before = scheduler_stats(tts)
    kprof = KernelProfile(cuda and kernel_profile_s > 0, spec.duration_s / 2, kernel_profile_s, trace_path)
    with timed_sampler(sample_stacks) as sampler, GilProbe() as gil, GpuUtilProbe(cuda) as gpu, kprof:
        records, end = drive(tts, arrivals, spec.duration_s, drain_s, speaker)
    if cuda:
        torch.cuda.synchronize()  # every stage span of the cell has completed
    after = scheduler_stats(tts)
    cell = {"setting": label, "rate": spec.rate, "duration_s": spec.duration_s, "drain_s": drain_s, "seed": spec.seed,
            "stream_fraction": spec.stream_fraction, **summarize(records, spec.duration_s, end),
            **stats_delta(before, after, end),
            "compiles": compiled_graph_count() - compiles,
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            # the caching allocator's retries / cudaMalloc / cudaFree in the cell
            "cuda_alloc": allocator_events(alloc),
            "gil_wait_ms": gil.summary(),  # a probe thread's lateness waking from 5 ms sleeps (gil_probe.py)
            "gpu_util_pct": gpu.summary(),  # nvidia-smi's utilization.gpu through the cell (gpu_util.py)
            # [arrival s, audio s, stream, first chunk s, last chunk s, chunks, status]
            "request_rows": [[round(r.arrival, 4), r.audio_s, r.stream,
                              round(r.chunk_t[0], 4) if r.chunk_t else None,
                              round(r.chunk_t[-1], 4) if r.chunk_t else None, len(r.chunk_t), r.status]
                             for r in records]}
    if sampler is not None:
        cell["stacks"] = sampler.summary()
    kernels = kprof.summary()
    if kernels is not None:
        cell["kernel_profile"] = kernels
    _settle(tts)
    errs = [r.error for r in records if r.status == FAILED and r.error]
    if errs:
        cell["first_error"] = errs[0]
    return cell


def _kernel_line(kp: dict) -> str:
    """One log line of a cell's kernel profile: the device's busy share, overlap, each launching thread's share."""
    if "error" in kp:
        return "failed: " + kp["error"]
    if not kp.get("kernels"):
        return "no kernels recorded"
    return (f"{kp['window_s']:.2f} s, {kp['kernels']} kernels; device busy {100 * kp['device_busy']:.0f} %, "
            f"concurrency {kp['concurrency']}; " + ", ".join(f"{who} {100 * r['busy']:.0f} %"
                                                            for who, r in kp["threads"].items()))


def _slug(label: str) -> str:
    """A setting's label as a file-name part (letters, digits, '-', '_', '.')."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "default"


ALLOC_EVENTS = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def allocator_events(since: dict | None = None) -> dict | None:
    """The CUDA caching allocator's event counters (`torch.cuda.memory_stats`: retries after a failed cudaMalloc,
    which free every cached block first; cudaMalloc / cudaFree calls, each cudaFree synchronising the device; OOMs),
    minus `since` when given; None without CUDA. A stage slowed by another's allocations would show here (one
    suspect for the graph-sampling A/B of runs 42-43, which slowed the DiT and vocoder with the GPU's memory nearly
    full)."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    now = {k: int(stats.get(k, 0)) for k in ALLOC_EVENTS}
    return now if since is None else {k: now[k] - since.get(k, 0) for k in ALLOC_EVENTS}


def _fmt(v, f=".3f"):
    return "-" if v is None else format(v, f)


def _gpu_memory(device) -> dict:
    """Reserved / allocated GPU memory and the device's used share, in GB, after a set-up (graph pools included);
    empty on the CPU."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"gpu_reserved_gb": round(torch.cuda.memory_reserved(device) / 1e9, 2),
            "gpu_allocated_gb": round(torch.cuda.memory_allocated(device) / 1e9, 2),
            "gpu_used_gb": round((total - free) / 1e9, 2)}


def bench_open_loop(cfg, llm, flow, hift, device, bench, variant: str, specs: list[OpenLoopSpec],
                    rates: list[float], drain_s: float, ab: list[str], jobs: "JobQueue | None" = None) -> dict:
    """The rate sweep per A/B setting and per spec (the streaming shares of `--stream-fraction 1,0`; usually one) on
    the `variant` pipeline; results under bench.results["open_loop"], saved after every cell. With several specs each
    sweep's label names its share. With `jobs` (`--keep-alive DIR`): instead, after the pipeline's set-up, the jobs
    that arrive in that folder (`JobQueue.serve`), each with its own rates and settings over the same pipeline and
    TTS, until it has been idle for its time."""
    out: dict = {"variant": variant, "spec": specs[0].to_dict(), "rates": rates, "cells": [], "settings": []}
    if len(specs) > 1:
        out["stream_fractions"] = [s.stream_fraction for s in specs]
    bench.results["open_loop"] = out
    t = time.perf_counter()
    models = random_models(cfg, llm, flow, hift, getattr(bench.args, "model", "full"))
    pipe = make_pipeline(models, variant, bench.args.graph_profile, getattr(bench.args, "engines", None))
    out["pipeline_setup_s"] = time.perf_counter() - t
    log(f"open loop {variant}: pipeline ready in {out['pipeline_setup_s']:.1f}s")
    tts = None  # one TTS for all settings where their AR runner fields agree (start_tts swaps its scheduler)
    try:
        if jobs is None:
            tts = run_settings(bench, out, pipe, variant, specs, rates, drain_s, ab, tts)
        else:  # the process's own rates / settings are not run: each job brings its own
            tts = jobs.serve(lambda b, o, sp, r, d, a, t_: run_settings(b, o, pipe, variant, sp, r, d, a, t_), tts)
    finally:
        if tts is not None:
            tts.close(close_backends=False)  # the pipeline (and its graphs) may serve another section
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def run_settings(bench, out: dict, pipe, variant: str, specs: list[OpenLoopSpec], rates: list[float],
                 drain_s: float, ab: list[str], tts=None):
    """Each A/B setting of `ab` over `pipe`: its scheduler (`start_tts`, over `tts` where it can), then its rate
    sweeps into `out` ("settings", "cells"; its "variant" too: a keep-alive job's `out` is made without it). Returns
    the TTS of the last setting (still open)."""
    out.setdefault("variant", variant)
    base = scheduler_config(variant, max_in_flight=OPEN_LOOP_MAX_IN_FLIGHT)
    settings, skipped = ab_settings(base, ab)
    for msg in skipped:
        log(msg)
    out.setdefault("ab_skipped", []).extend(skipped)
    speaker = pipe.default_speaker  # the bench's saved speaker (random frontend)
    if any(o.get("flow_prefix_cache") for _, o in settings) and pipe.device.type == "cuda" \
            and "cached_hop_check" not in out:
        from .hop_check import cached_hop_check

        out["cached_hop_check"] = jsonable(cached_hop_check(pipe))
        bench.save()
        log(f"cached hop check: {out['cached_hop_check']}")
    for label, overrides in settings:
        if bench.over_budget():
            log(f"open loop: skip setting {label!r} (time budget)")
            continue
        t = time.perf_counter()
        tts = start_tts(pipe, dataclasses.replace(base, **overrides), tts)
        setup = time.perf_counter() - t
        mem = _gpu_memory(pipe.device)
        parts = (scheduler_stats(tts) or {}).get("setup_s") or {}  # the rest of `setup`: the warm-up requests
        out["settings"].append({"label": label, "overrides": overrides, "scheduler_setup_s": setup,
                                "scheduler_setup_parts_s": parts, **mem})
        log(f"open loop {variant} / {label}: scheduler ready in {setup:.1f}s ("
            + ", ".join(f"{k} {v:.1f}s" for k, v in parts.items()) + f"); GPU memory {mem}")
        if len(out["settings"]) == 1 and getattr(bench.args, "compile_cache", None):
            # the compiles are done: keep them even if the device call's time limit cuts the cells short (a
            # cold compiled set-up can take most of a call; the next call then starts from this cache)
            from ...runtime.stages.compiled import save_compile_cache

            log(f"saved compile cache {bench.args.compile_cache}: "
                f"{save_compile_cache(bench.args.compile_cache) / 1e6:.1f} MB")
        try:
            for one in specs:
                name = label if len(specs) == 1 else f"{label} / {100 * one.stream_fraction:.0f}% streams"
                _rate_sweep(bench, out, tts, name, one, rates, drain_s, speaker)
        finally:
            out["settings"][-1]["stats"] = jsonable(scheduler_stats(tts))
    return tts


class JobQueue:
    """Open-loop jobs for a bench process that stays up (`trtbuild bench --keep-alive DIR`): on the lent GPU machine
    the set-up (compiles, CUDA graphs, the first scheduler) takes 5-6 minutes of a 10-minute device call, and a
    process started in the background survives between calls while the machine stays warm (BENCHMARKS.md run 49).
    `benchmarks/bench_job.sh` queues a job as DIR/queue/ID.json (a JSON list of open-loop bench flags: --rates,
    --ab, --duration-s, ...) and waits for DIR/done/ID/ (results.json, and DONE when it is complete). Jobs run one at
    a time, oldest first, over the same pipeline and TTS. `parse(argv)` -> (args, specs, rates, ab) for a job's
    flags (args.out set to its folder). The loop ends after `idle_s` seconds without a job."""

    def __init__(self, folder: str, parse, idle_s: float = 600.0, poll_s: float = 0.5):
        self.folder, self.parse, self.idle_s, self.poll_s = folder, parse, idle_s, poll_s
        for sub in ("queue", "done"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)

    def next_job(self) -> tuple[str, list] | None:
        """The oldest queued job as (id, flags), taken off the queue; None when none is queued. A job file that is
        not a JSON list of strings finishes at once with its error."""
        q = os.path.join(self.folder, "queue")
        names = sorted((f for f in os.listdir(q) if f.endswith(".json")),
                       key=lambda f: (os.path.getmtime(os.path.join(q, f)), f))
        if not names:
            return None
        path = os.path.join(q, names[0])
        job_id = names[0][:-len(".json")]
        try:
            with open(path) as f:
                flags = json.load(f)
            if not isinstance(flags, list) or not all(isinstance(x, str) for x in flags):
                raise ValueError("a job is a JSON list of bench flags (strings)")
        except (OSError, ValueError) as e:
            flags = e
        os.remove(path)
        return job_id, flags

    def serve(self, run, tts):
        """Run jobs until idle: `run(bench, out, specs, rates, drain_s, ab, tts)` -> tts per job, each job with a
        `Bench` of its own (its flags' time budget and output folder). Returns the last TTS."""
        from .common import Bench

        log(f"keep-alive: waiting for jobs in {self.folder}/queue (idle limit {self.idle_s:g}s)")
        idle_since = time.perf_counter()
        while time.perf_counter() - idle_since < self.idle_s:
            job = self.next_job()
            if job is None:
                time.sleep(self.poll_s)
                continue
            job_id, flags = job
            done = os.path.join(self.folder, "done", job_id)
            os.makedirs(done, exist_ok=True)
            status = "ok"
            try:
                if isinstance(flags, Exception):
                    raise flags
                args, specs, rates, ab = self.parse(flags, done)
                b = Bench(args)
                out: dict = {"spec": specs[0].to_dict(), "rates": rates, "cells": [], "settings": [], "job": job_id,
                             "flags": flags}
                b.results["open_loop"] = out
                log(f"keep-alive: job {job_id}: {' '.join(flags)}")
                tts = run(b, out, specs, rates, args.drain_s, ab, tts)
                b.save()
            except Exception as e:  # noqa: BLE001 - a bad job must not end the process that serves the next
                import traceback

                traceback.print_exc()
                status = f"error: {type(e).__name__}: {e}"
            with open(os.path.join(done, "DONE"), "w") as f:
                f.write(status + "\n")
            log(f"keep-alive: job {job_id} done ({status})")
            idle_since = time.perf_counter()
        log("keep-alive: idle limit reached, stopping")
        return tts


def _rate_sweep(bench, out, tts, label, spec, rates, drain_s, speaker) -> None:
    """One setting's cells, rate after rate, until the time budget or saturation."""
    for rate in rates:
        if bench.over_budget():
            log(f"open loop {label}: skip rate {rate:g} (time budget)")
            break
        try:
            kp_s = float(getattr(bench.args, "kernel_profile_s", 0.0) or 0.0)
            trace = (os.path.join(bench.args.out, f"trace_{_slug(label)}_{rate:g}.json.gz")
                     if kp_s > 0 and getattr(bench.args, "kernel_trace", False) else None)
            cell = run_open_loop_cell(tts, spec.at_rate(rate), drain_s, speaker, label,
                                      getattr(bench.args, "sample_stacks", False), kp_s, trace)
        except Exception as e:  # noqa: BLE001 - the sweep goes on with the next setting
            import traceback

            traceback.print_exc()
            out["cells"].append({"setting": label, "rate": rate, "error": repr(e)})
            bench.save()
            break
        why = saturated(cell)
        cell["saturated"] = why
        out["cells"].append(jsonable(cell))
        bench.save()
        t_ = cell["ttfa"]
        log(f"open loop {label} {rate:g} req/s: offered {cell['offered_audio_s_per_s']:.1f}, achieved "
            f"{cell['achieved_audio_s_per_s']:.1f} audio s/s; TTFA p50 {_fmt(t_['p50'])} p95 "
            f"{_fmt(t_['p95'])} p99 {_fmt(t_['p99'])} s; underruns {cell['underrun_requests']} of "
            f"{cell['streams']} streams ({cell['stall_s']:.1f} s stalled); {cell['unfinished']} unfinished, "
            f"{cell['failed']} failed" + (f", {cell['shed']} shed" if cell.get("shed") else "") + "; busy "
            + ", ".join(f"{k} {v:.2f}" for k, v in cell["busy"].items())
            + f"; GIL wait p50 {_fmt(cell['gil_wait_ms']['p50'], '.2f')} p95 "
              f"{_fmt(cell['gil_wait_ms']['p95'], '.2f')} ms"
            + (f"; GPU util mean {cell['gpu_util_pct']['mean']} %" if cell["gpu_util_pct"]["n"] else "")
            + (f"; allocator retries {cell['cuda_alloc']['num_alloc_retries']}, cudaFree "
               f"{cell['cuda_alloc']['num_device_free']}" if cell.get("cuda_alloc") else "")
            + (f"; AR {cell['ar_steps']['rows_per_step']:.2f} rows/step, {100 * cell['ar_steps']['sampled_share']:.0f} "
               "% sampled in graph" if (cell.get("ar_steps") or {}).get("sampled_share") is not None else "")
            + _host_line(cell.get("host"), (cell.get("ar_steps") or {}).get("multi_step_calls"))
            + _anatomy_line(cell.get("ar_steps"))
            + _waits_line(cell.get("waits"))
            + (f"; WARNING: {cell['compiles']} graph(s) compiled during the cell" if cell["compiles"] else ""))
        kp = cell.get("kernel_profile")
        if kp:
            log(f"open loop {label} {rate:g} req/s: kernel profile " + _kernel_line(kp))
        if why:
            log(f"open loop {label}: saturated at {rate:g} req/s ({why}): higher rates skipped")
            break

