"""The serving matrix through the scheduler (part of `trtbuild bench --suite serving`)."""
from __future__ import annotations

import time

import torch

from ..runtime.metrics import aggregate

TOKENS = {"short": 125, "medium": 375, "long": 1000}  # ~5 s, 15 s, 40 s of audio at 25 Hz


def _cells(quick: bool, variant: str) -> list[tuple]:
    """(text, concurrency, stream, reference audio) cells for one variant."""
    if variant == "eager":
        return [("short", 1, True, False), ("short", 1, False, False), ("short", 32, True, False),
                ("short", 32, False, False)]
    cells = [("short", 1, True, False), ("short", 1, False, False), ("short", 1, True, True),
             ("short", 8, True, False), ("short", 32, True, False), ("short", 32, False, False),
             ("short", 64, False, False), ("medium", 1, True, False), ("medium", 32, True, False),
             ("medium", 64, False, False)]
    if not quick:
        cells += [("short", 8, False, False), ("short", 64, True, False), ("medium", 8, True, False),
                  ("long", 1, True, False), ("long", 8, False, False)]
    return cells


def run_cell(tts, text: str, conc: int, stream: bool, ref_audio: bool, prompt_wav) -> dict:
    from ..runtime.request import Request
    from ..runtime.sampling import SamplingParams

    n = TOKENS[text]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    handles = []
    for i in range(conc):
        kw = dict(prompt_wav=prompt_wav, prompt_sr=16000, prompt_text="a prompt of three seconds") if ref_audio else {}
        req = Request(text="a" * 40, stream=stream, sampling=SamplingParams(seed=i, force_tokens=n), **kw)
        handles.append(tts.submit(req))
    audio = 0.0
    for h in handles:
        audio += h.result(timeout=600).size / 24000
    wall = time.perf_counter() - t0
    agg = aggregate([h.metrics for h in handles])
    return {"text": text, "tokens": n, "concurrency": conc, "stream": stream, "reference_audio": ref_audio,
            "wall_s": wall, "audio_s": audio, "throughput_audio_s_per_s": audio / wall,
            "ttfa": agg["ttfa"], "inter_chunk": agg["inter_chunk"], "rtf": agg["rtf"], "total": agg["total"],
            "T_tokenizer": agg["T_tokenizer"]["mean"], "T_AR": agg["T_AR"]["mean"], "T_DiT": agg["T_DiT"]["mean"],
            "T_vocoder": agg["T_vocoder"]["mean"], "T_queue": agg["T_queue"]["mean"],
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None}


def bench_serving(cfg, llm, flow, hift, device, quick: bool, bench) -> dict:
    from ..runtime.engine_set import attach_cuda_graphs
    from ..runtime.model import CosyVoice3Models
    from ..runtime.pipeline import Pipeline
    from ..runtime.profile import load_profile
    from ..runtime.request import default_voice_wav
    from ..runtime.scheduler import SchedulerConfig
    from ..runtime.tts import TTS
    from .bench import _log, _pipeline_with_random_frontend

    models = CosyVoice3Models(cfg, llm, flow, hift, "random-full", "", "random")
    prompt = default_voice_wav(16000, 3.0)
    out: dict = {"cells": []}
    for variant in ("graphs", "eager"):
        if bench.over_budget():
            _log(f"serving: skip variant {variant} (time budget)")
            continue
        pipe = _pipeline_with_random_frontend(models, Pipeline)
        t = time.perf_counter()
        try:
            if variant == "graphs":
                attach_cuda_graphs(pipe, load_profile(bench.args.graph_profile))
            sched = SchedulerConfig(max_in_flight=128, ar_max_batch=64, dit_max_requests=8, hift_max_batch=16,
                                    cuda_graphs=variant == "graphs", ar_max_len=2048)
            tts = TTS(pipe, scheduler=sched)
            tts.synthesize("a" * 40, seed=0, force_tokens=50)  # start the scheduler (captures decode graphs), warm
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            out[f"{variant}_error"] = repr(e)
            continue
        out[f"{variant}_setup_s"] = time.perf_counter() - t
        _log(f"serving {variant}: setup {out[f'{variant}_setup_s']:.1f}s")
        for cell in _cells(quick, variant):
            if bench.over_budget():
                _log("serving: time budget spent")
                break
            try:
                r = run_cell(tts, *cell, prompt_wav=prompt)
            except Exception as e:  # noqa: BLE001
                r = {"cell": list(cell), "error": repr(e)}
            r["variant"] = variant
            out["cells"].append(r)
            if "error" not in r:
                _log(f"serving {variant} {cell}: TTFA p50 {r['ttfa']['p50']:.3f}s p95 {r['ttfa']['p95']:.3f}s, "
                     f"RTF p50 {r['rtf']['p50']:.3f}, {r['throughput_audio_s_per_s']:.1f} audio s/s")
            else:
                _log(f"serving {variant} {cell}: {r['error']}")
            bench.results["serving"] = out
            bench.save()
        out[f"{variant}_stats"] = _jsonable(tts.metrics().get("scheduler", tts.metrics()))
        tts.close()
        del tts, pipe
        torch.cuda.empty_cache()
    return out


def _jsonable(d):
    import json

    return json.loads(json.dumps(d, default=str))
