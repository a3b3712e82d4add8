"""`trtbuild synth --batch JOBS.jsonl --out-dir DIR`: an offline batch job. Every line of the JSONL file is one
utterance; all of them go through one TTS (the scheduler batches up to `--concurrency` requests at once), each is
written to DIR as soon as it is done (atomically: a file is complete or absent), and DIR/results.jsonl records every
line's outcome. A failed line does not stop the others (exit 1 at the end when any failed); `--resume` skips lines
whose output exists, so an interrupted job continues where it stopped.

A line (unknown keys are an error naming the line):

    {"text": "Hello.", "out": "greeting.wav", "seed": 1}
    {"text": "In my voice.", "speaker": "alice.spk"}            # a saved speaker (trtbuild synth --save-speaker)
    {"text": "Cloned.", "prompt_wav": "ref.wav", "prompt_text": "Transcript of ref."}
    {"text": "...", "instruct": "Speak slowly.<|endofprompt|>", "max_tokens": 500, "speed": 1.1}

`out` defaults to NNNNN.wav (the line's number); its extension picks the format (.wav .flac .mp3 .opus .ogg).
Relative paths (`out`, `speaker`, `prompt_wav`) are taken from DIR / the JSONL file's folder; `out` may not leave DIR.
Every line is checked before the model loads."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from ..engines.errors import CosytrtError, InputError
from ._cli import AUDIO_FORMATS, read_jsonl, write_audio

KEYS = {"text", "out", "seed", "speaker", "prompt_wav", "prompt_text", "instruct", "max_tokens", "force_tokens",
        "top_p", "top_k", "greedy", "speed"}
SAMPLING = ("seed", "max_tokens", "force_tokens", "top_p", "top_k", "greedy")


@dataclass
class Job:
    line: int   # 1-based line of the JSONL file
    out: str    # relative to the output folder
    text: str
    options: dict  # make_request keywords


def load_jobs(path: str) -> list[Job]:
    """The JSONL file's jobs, every line checked (InputError naming the first bad line); blank and # lines
    skipped."""
    from ..runtime.tts import make_request

    base = os.path.dirname(os.path.abspath(path))
    jobs, outs = [], {}
    for n, where, obj in read_jsonl(path, "--batch "):
        if not isinstance(obj, dict):
            raise InputError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - KEYS)
        if unknown:
            raise InputError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(KEYS))}")
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{where}: 'text' must be a non-empty string")
        out = obj.get("out", f"{n:05d}.wav")
        if not isinstance(out, str) or not out or os.path.isabs(out) or ".." in out.replace("\\", "/").split("/"):
            raise InputError(f"{where}: 'out' must be a relative path inside the output folder, got {out!r}")
        if os.path.splitext(out)[1].lower() not in AUDIO_FORMATS:
            raise InputError(f"{where}: 'out' {out!r} needs an audio extension ({', '.join(AUDIO_FORMATS)})")
        key = os.path.normpath(out)
        if key in outs:
            raise InputError(f"{where}: 'out' {out!r} is also line {outs[key]}'s")
        outs[key] = n
        opts = {k: obj[k] for k in SAMPLING if k in obj}
        for k in ("speaker", "prompt_wav"):
            if k in obj:
                p = obj[k]
                if not isinstance(p, str):
                    raise InputError(f"{where}: '{k}' must be a file path")
                p = p if os.path.isabs(p) else os.path.join(base, p)
                if not os.path.isfile(p):
                    raise InputError(f"{where}: '{k}' file {p} does not exist")
                opts[k] = p
        for k in ("prompt_text", "instruct"):
            if k in obj:
                if not isinstance(obj[k], str):
                    raise InputError(f"{where}: '{k}' must be a string")
                opts[k] = obj[k]
        if "speed" in obj:
            opts["speed"] = obj["speed"]
        try:
            make_request(text, **opts)  # the sampling options' own checks
        except (CosytrtError, TypeError, ValueError) as e:
            raise InputError(f"{where}: {e}") from None
        jobs.append(Job(n, out, text, opts))
    if not jobs:
        raise InputError(f"--batch {path!r} has no jobs")
    return jobs


def _write_atomic(path: str, wav, sample_rate: int) -> None:
    root, ext = os.path.splitext(path)
    tmp = f"{root}.part{ext}"
    write_audio(tmp, wav, sample_rate)
    os.replace(tmp, path)


def run_jobs(tts, jobs: list[Job], out_dir: str, concurrency: int, resume: bool = False, progress=None) -> list[dict]:
    """Synthesise every job through `tts` with at most `concurrency` requests in flight; one result dict per job
    (in job order): status ok / skipped / error, audio seconds, tokens, seconds from submit to done, the error."""
    def one(job: Job) -> dict:
        path = os.path.join(out_dir, job.out)
        rec = {"line": job.line, "out": job.out}
        if resume and os.path.exists(path):
            return {**rec, "status": "skipped"}
        t0 = time.perf_counter()
        try:
            h = tts.submit(job.text, **job.options)
            wav = h.result()
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            _write_atomic(path, wav, tts.sample_rate)
        except (CosytrtError, OSError, RuntimeError, ValueError) as e:
            return {**rec, "status": "error", "error": f"{type(e).__name__}: {e}"}
        m = h.metrics
        return {**rec, "status": "ok", "audio_seconds": round(float(m.audio_seconds), 4), "tokens": int(m.tokens),
                "seconds": round(time.perf_counter() - t0, 4)}

    results: list[dict | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="cosytrt-batch") as pool:
        futures = {pool.submit(one, job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            r = results[futures[fut]] = fut.result()
            if progress is not None:
                progress(r)
    return results  # type: ignore[return-value]


def summarize(results: list[dict], wall_s: float) -> dict:
    ok = [r for r in results if r["status"] == "ok"]
    audio = sum(r["audio_seconds"] for r in ok)
    lat = sorted(r["seconds"] for r in ok)

    def q(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else None

    return {"jobs": len(results), "ok": len(ok), "skipped": sum(r["status"] == "skipped" for r in results),
            "failed": sum(r["status"] == "error" for r in results), "audio_seconds": round(audio, 3),
            "wall_seconds": round(wall_s, 3), "audio_seconds_per_second": round(audio / wall_s, 3) if wall_s else None,
            "seconds_per_job_p50": q(0.5), "seconds_per_job_p95": q(0.95),
            "seconds_per_job_mean": round(statistics.fmean(lat), 4) if lat else None}


def run(args, tts_factory) -> int:
    """The `--batch` form of `trtbuild synth`; `tts_factory()` loads the TTS (after every line is checked)."""
    from .table import format_table

    jobs = load_jobs(args.batch)
    out_dir = args.out_dir
    if not out_dir:
        raise InputError("--batch needs --out-dir (where the audio files and results.jsonl go)")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:  # a file there, or a file on the way
        raise InputError(f"--out-dir {out_dir!r}: cannot make the folder ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK):
        raise InputError(f"--out-dir {out_dir!r} is not writable")
    tts = tts_factory()
    # at most the runtime's slots: a request beyond them would wait for admission, and one waiting past the
    # admission timeout behind long utterances would fail although nothing is wrong with it
    slots = int(getattr(getattr(tts, "admission", None), "max_in_flight", 8))
    concurrency = min(args.concurrency or slots, slots)
    from tqdm import tqdm

    bar = tqdm(total=len(jobs), desc="synthesising", unit="utt", file=sys.stderr, disable=args.json)

    def progress(r: dict) -> None:
        bar.update(1)
        if r["status"] == "error":
            bar.write(f"line {r['line']}: {r['error']}", file=sys.stderr)

    t0 = time.perf_counter()
    try:
        results = run_jobs(tts, jobs, out_dir, concurrency, resume=args.resume, progress=progress)
    finally:
        bar.close()
        tts.close()
    summary = summarize(results, time.perf_counter() - t0)
    with open(os.path.join(out_dir, "results.jsonl"), "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    if args.json:
        print(json.dumps({**summary, "out_dir": out_dir, "concurrency": concurrency}, indent=1))
    else:
        rows = [[k.replace("_", " "), v] for k, v in summary.items()]
        print(format_table(["batch", "value"], rows,
                           title=f"{out_dir}: {summary['ok']} written, {summary['failed']} failed "
                                 f"(results.jsonl), concurrency {concurrency}"))
    return 1 if summary["failed"] else 0
