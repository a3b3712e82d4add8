"""The serving matrix and the scheduler-feature comparison through the scheduler (`trtbuild bench --suite
serving,features`).

Variants (same models, same process, so ratios compare like with like):
- `eager`: the scheduler with every stage eager (no CUDA graphs, no compile).
- `graphs`: AR decode CUDA graphs per (batch bucket, KV rung) + DiT / offline HiFT / streaming HiFT windows captured
  per bucket of the graph profile (eager modules).
- `compiled`: the same graphs, captured from torch.compile'd AR decode / prefill and DiT (`runtime/stages/compiled.py`).

Cells: text short / medium / long (125 / 375 / 1000 forced speech tokens = 5 / 15 / 40 s of audio; `mixed`
alternates short and long) x concurrency x stream / offline x reference audio (prompt audio through the frontend for
every request) or a saved speaker. A cell submits its requests at once, or spread evenly over `arrival_s` seconds.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .common import (VARIANTS, jsonable as _jsonable, log as _log, make_pipeline, random_models, scheduler_config,
                     start_tts as _start)
from ...runtime.stages.compiled import compiled_graph_count
from ...runtime.scheduling.stage_clock import occupancy
from ...runtime.scheduling.metrics import aggregate
from ...runtime.scheduling.policies import POLICIES as FEATURES

TOKENS = {"short": (125,), "medium": (375,), "long": (1000,), "mixed": (125, 1000)}  # 25 tokens = 1 s of audio
CELL_TIMEOUT_S = 120.0  # a request of a cell not done by then fails the cell (recorded) and the run goes on


@dataclasses.dataclass(frozen=True)
class Cell:
    text: str
    concurrency: int
    stream: bool
    reference_audio: bool = False
    arrival_s: float = 0.0  # submit the requests evenly over this many seconds (0: all at once)


def full_matrix() -> list[Cell]:
    return [Cell(text, c, stream, ref) for text in ("short", "medium", "long") for c in (1, 8, 32, 64)
            for stream in (True, False) for ref in (False, True)]


def comparison_cells() -> list[Cell]:
    """The cells every variant runs (the ratios in BENCHMARKS.md)."""
    return [Cell("short", 1, True), Cell("short", 1, False), Cell("short", 32, True), Cell("short", 32, False),
            Cell("medium", 64, False)]


def quick_cells() -> list[Cell]:
    return comparison_cells() + [Cell("short", 1, True, True), Cell("short", 8, True), Cell("medium", 1, True),
                                 Cell("medium", 32, True), Cell("short", 64, False)]


def smoke_cells() -> list[Cell]:
    """A CPU check of the harness itself (tiny model): seconds, not minutes."""
    return [Cell("short", 2, True), Cell("short", 2, False, True, arrival_s=0.1)]


CELL_SETS = {"full": full_matrix, "quick": quick_cells, "smoke": smoke_cells}


def feature_cells() -> list[Cell]:
    """Where each policy matters: a streaming wave arriving over a second (continuous batching, chunk-aligned DiT,
    async copies) and an offline wave of mixed lengths (length-aware HiFT)."""
    return [Cell("short", 32, True, arrival_s=1.0), Cell("mixed", 64, False, arrival_s=1.0)]


def run_cell(tts, cell: Cell, prompt_wav) -> dict:
    from ...runtime.stages.request import Request
    from ...runtime.models.sampling import SamplingParams

    lengths = TOKENS[cell.text]
    compiles = compiled_graph_count()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    busy0 = tts.scheduler.clock.busy_s()
    t0 = time.perf_counter()
    handles = []
    for i in range(cell.concurrency):
        if cell.arrival_s and i:
            time.sleep(max(0.0, t0 + cell.arrival_s * i / cell.concurrency - time.perf_counter()))
        kw = dict(prompt_wav=prompt_wav, prompt_sr=16000, prompt_text="a prompt of three seconds") \
            if cell.reference_audio else {}
        n = lengths[i % len(lengths)]
        req = Request(text="a" * 40, stream=cell.stream, sampling=SamplingParams(seed=i, force_tokens=n), **kw)
        handles.append(tts.submit(req))
    audio = 0.0
    for h in handles:
        audio += h.result(timeout=CELL_TIMEOUT_S).size / 24000
    wall = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # every stage span of the cell has completed
    agg = aggregate([h.metrics for h in handles])
    return {**dataclasses.asdict(cell), "tokens": list(lengths), "wall_s": wall, "audio_s": audio,
            "throughput_audio_s_per_s": audio / wall, "ttfa": agg["ttfa"],
            "ttfa_samples": sorted(h.metrics.ttfa for h in handles if h.metrics.ttfa is not None),
            "inter_chunk": agg["inter_chunk"], "rtf": agg["rtf"], "total": agg["total"],
            "T_tokenizer": agg["T_tokenizer"]["mean"], "T_AR": agg["T_AR"]["mean"], "T_DiT": agg["T_DiT"]["mean"],
            "T_vocoder": agg["T_vocoder"]["mean"], "T_queue": agg["T_queue"]["mean"],
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
            "compiles": compiled_graph_count() - compiles,  # > 0: a compile stalled this cell
            "occupancy": occupancy(busy0, tts.scheduler.clock.busy_s(), wall)}  # busy fraction per stage


def _run_cells(tts, cells, label: str, out: list, bench, prompt) -> None:
    for cell in cells:
        if bench.over_budget():
            _log(f"{label}: time budget spent")
            return
        try:
            r = run_cell(tts, cell, prompt)
        except Exception as e:  # noqa: BLE001
            import faulthandler
            import sys

            faulthandler.dump_traceback(sys.stderr, all_threads=True)  # where the workers are (a stuck cell)
            r = {**dataclasses.asdict(cell), "error": repr(e)}
        r["variant"] = label
        out.append(r)
        if "error" not in r:
            _log(f"{label} {cell}: TTFA p50 {r['ttfa']['p50']:.3f}s p95 {r['ttfa']['p95']:.3f}s, "
                 f"RTF p50 {r['rtf']['p50']:.3f}, {r['throughput_audio_s_per_s']:.1f} audio s/s"
                 + (f"; WARNING: {r['compiles']} torch.compile graph(s) compiled during the cell" if r["compiles"]
                    else ""))
        else:
            _log(f"{label} {cell}: {r['error']}")
        bench.save()


def bench_serving(cfg, llm, flow, hift, device, bench, variants=VARIANTS, cells: str = "full",
                  matrix: bool = True, features: bool = False) -> dict:
    """`matrix`: the comparison cells for every variant (the others first, the primary `variants[0]` last), then the
    rest of the cell set `cells` (full / quick / smoke) on the primary. `features`: on the primary variant's
    pipeline, the feature off/on comparison (results under "features"), before the rest of the matrix.
    Ratio-critical cells come first, so a run cut short by --budget-s keeps them."""
    from ...runtime.stages.request import default_voice_wav
    models = random_models(cfg, llm, flow, hift, getattr(bench.args, "model", "full"))
    prompt = default_voice_wav(16000, 3.0)
    out: dict = {"cells": []}
    bench.results["serving"] = out
    primary = variants[0]
    first = smoke_cells() if cells == "smoke" else comparison_cells()
    for variant in (list(variants[1:]) if matrix else []) + [primary]:
        if bench.over_budget():
            _log(f"serving: skip variant {variant} (time budget)")
            continue
        t = time.perf_counter()
        compiles = compiled_graph_count()
        try:
            pipe = make_pipeline(models, variant, bench.args.graph_profile, getattr(bench.args, "engines", None))
            t_pipe = time.perf_counter() - t
            tts = _start(pipe, scheduler_config(variant))
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            out[f"{variant}_error"] = repr(e)
            continue
        out[f"{variant}_setup_s"] = time.perf_counter() - t
        out[f"{variant}_setup"] = {"dit_hift_graphs_s": t_pipe, "scheduler_s": out[f"{variant}_setup_s"] - t_pipe,
                                   "dynamo_graphs": compiled_graph_count() - compiles}
        _log(f"serving {variant}: setup {out[f'{variant}_setup_s']:.1f}s (DiT / HiFT graphs {t_pipe:.1f}s; scheduler "
             f"with the AR compile, decode graphs and warm-up {out[f'{variant}_setup']['scheduler_s']:.1f}s; "
             f"{out[f'{variant}_setup']['dynamo_graphs']} graphs compiled)")
        if matrix:
            _run_cells(tts, first, variant, out["cells"], bench, prompt)
        if variant == primary:
            if features:
                bench.results["features"] = _features(tts, variant, cells, bench, prompt)
            if matrix:
                _run_cells(tts, [c for c in CELL_SETS[cells]() if c not in first], variant, out["cells"], bench,
                           prompt)
        out[f"{variant}_stats"] = _jsonable(tts.metrics())
        tts.close()
        del tts, pipe
        torch.cuda.empty_cache()
    return out


ALL_ON_REPEAT = "all on (repeat)"
COMPILED_HIFT = "compiled_hift"  # a features setting that is not a scheduler policy: the HiFT graphs' variant


def _features(tts, variant: str, cells: str, bench, prompt) -> dict:
    """Each batching policy off vs all on: one scheduler per setting over the TTS's AR runner and stage backends
    (same graphs, same caches); `compiled_hift off` runs the eager vocoder's HiFT graphs (other StageBackends of the
    same graph set). "all on" runs first and again last (ALL_ON_REPEAT): the two show how much a cell moves between
    runs of the same setting (the report compares against their mean)."""
    from dataclasses import replace
    from types import SimpleNamespace

    out: dict = {"variant": variant, "cells": []}
    graph_set = tts.pipeline.backends.engine_set
    has_compiled_hift = "compiled" in getattr(graph_set, "hift_variants", {})
    settings = [("all on", None)] + [(f"{f} off", f) for f in FEATURES]
    if has_compiled_hift:  # the compiled variant's HiFT graphs vs the eager vocoder's graphs
        settings.append((f"{COMPILED_HIFT} off", COMPILED_HIFT))
    for label, off in settings + [(ALL_ON_REPEAT, None)]:
        if bench.over_budget():
            _log(f"features: skip {label} (time budget)")
            continue
        config = replace(tts.scheduler_config, **{f: f != off for f in FEATURES})
        backends = graph_set.backends("eager") if off == COMPILED_HIFT else None
        sched = tts.make_scheduler(config, backends=backends)
        try:
            _run_cells(SimpleNamespace(submit=sched.submit, scheduler=sched),
                       smoke_cells() if cells == "smoke" else feature_cells(), label, out["cells"], bench, prompt)
        finally:
            sched.close()
    return out
