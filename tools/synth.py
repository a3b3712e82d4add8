"""`trtbuild synth`: synthesize speech to a 24 kHz mono file (WAV, FLAC, MP3 or Opus by the --out extension),
printing per-stage times, TTFA and RTF (`--json`: one JSON object); `--batch JOBS.jsonl --out-dir DIR`: a whole
offline batch through the scheduler (synth_batch.py)."""
from __future__ import annotations

import json
import sys

from ._cli import add_device, check_audio_out, check_file_out, write_audio
from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a CosyVoice3 model directory")
    p.add_argument("--engines", default=None, help="engine set folder built by `trtbuild build` (default: eager)")
    add_device(p)
    p.add_argument("--text", default=None, help="text to speak (or --batch)")
    p.add_argument("--batch", default=None, metavar="JOBS.jsonl",
                   help="an offline batch: one JSON object per line ({\"text\", \"out\", \"seed\", \"speaker\", "
                        "\"prompt_wav\", \"prompt_text\", \"instruct\", \"max_tokens\", ...}), all through one "
                        "scheduler; needs --out-dir")
    p.add_argument("--out-dir", default=None, help="with --batch: folder for the audio files and results.jsonl")
    p.add_argument("--concurrency", type=int, default=None,
                   help="with --batch: requests in flight at once (default: the runtime's max_in_flight)")
    p.add_argument("--resume", action="store_true", help="with --batch: skip lines whose output file exists")
    p.add_argument("--prompt-wav", default=None, help="reference audio (any common sample rate)")
    p.add_argument("--prompt-text", default=None, help="transcript of the reference audio (zero-shot mode)")
    p.add_argument("--instruct", default=None, help="instruction text (instruct mode), ending in <|endofprompt|>")
    p.add_argument("--speaker", default=None, help="saved speaker file (skips the frontend)")
    p.add_argument("--save-speaker", default=None, help="write the prompt's speaker features to this file")
    p.add_argument("--stream", action="store_true", help="stream (chunked) synthesis")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same audio)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of RAS sampling")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on generated speech tokens")
    p.add_argument("--force-tokens", type=int, default=None, help="generate exactly N tokens (benchmarks)")
    p.add_argument("--compile", action="store_true", help="torch.compile the LM and DiT (slow start, faster runs)")
    p.add_argument("--compile-cache", default=None, metavar="FILE",
                   help="with --compile: reuse / write torch.compile's artifacts in FILE")
    p.add_argument("--out", default=None, help="output audio path: .wav (16-bit PCM), .flac, .mp3 or .opus")
    p.add_argument("--json", action="store_true", help="print one JSON object (times, RTF, file hashes) instead of "
                   "the table")


def run(args) -> int:
    from ..runtime.stages.request import Request
    from ..runtime.models.sampling import SamplingParams
    from ..runtime.tts import TTS

    from ..engines.errors import InputError

    def load():
        return TTS.load(model=args.model, engines=args.engines, device=args.device, compile=args.compile,
                        compile_cache=args.compile_cache)

    if (args.text is None) == (args.batch is None):
        raise InputError("give --text (one utterance) or --batch JOBS.jsonl (an offline batch), not both")
    if args.batch is not None:
        single = [f for f in ("out", "prompt_wav", "prompt_text", "instruct", "speaker", "save_speaker",
                              "force_tokens", "max_tokens") if getattr(args, f) is not None] + \
            (["stream"] if args.stream else [])
        if single:
            raise InputError(f"--batch takes its options per line, not --{single[0].replace('_', '-')}")
        if args.concurrency is not None and args.concurrency < 1:
            raise InputError(f"--concurrency must be >= 1, got {args.concurrency}")
        from .synth_batch import run as run_batch

        return run_batch(args, load)
    if args.out is None:
        raise InputError("--text needs --out (the audio file to write)")
    check_audio_out(args.out)  # a bad extension or folder fails now, not after the synthesis
    if args.save_speaker:
        if not args.prompt_wav:
            raise InputError("--save-speaker needs --prompt-wav")
        check_file_out(args.save_speaker, "--save-speaker")
    tts = load()
    models = tts.pipeline.models
    if not args.json:
        from ..runtime.models.loading import describe_hashes

        print(describe_hashes(models), file=sys.stderr)
    if args.save_speaker:
        tts.save_speaker(args.save_speaker, args.prompt_wav, args.prompt_text or "")
        print(f"saved speaker to {args.save_speaker}")
    sampling = SamplingParams(seed=args.seed, greedy=args.greedy, max_tokens=args.max_tokens,
                              force_tokens=args.force_tokens)
    req = Request(text=args.text, prompt_wav=args.prompt_wav, prompt_text=args.prompt_text, instruct=args.instruct,
                  speaker=args.speaker, stream=args.stream, sampling=sampling)
    wav, m = tts.synthesize_request(req)
    write_audio(args.out, wav, tts.sample_rate)
    if args.json:
        es = getattr(tts.pipeline, "engine_set", None)
        print(json.dumps({"out": args.out, "sample_rate": tts.sample_rate, "tokens": m.tokens,
                          "audio_seconds": m.audio_seconds, "t_tokenizer": m.t_tokenizer, "t_ar": m.t_ar,
                          "t_dit": m.t_dit, "t_vocoder": m.t_vocoder, "t_queue": m.t_queue, "ttfa": m.ttfa,
                          "total": m.total, "rtf": m.rtf, "model": models.model_dir,
                          "weights_hash": models.weights_hash, "model_files": models.file_hashes,
                          "engines": args.engines, "backend": getattr(getattr(es, "manifest", None), "backend", None)},
                         indent=1))
        return 0
    rows = [["T_tokenizer", m.t_tokenizer], ["T_AR", m.t_ar], ["T_DiT", m.t_dit], ["T_vocoder", m.t_vocoder],
            ["T_queue", m.t_queue], ["time to first audio", m.ttfa or 0.0], ["total", m.total],
            ["audio", m.audio_seconds], ["RTF", m.rtf]]
    print(format_table(["stage", "seconds"], rows,
                       title=f"wrote {args.out}: {m.tokens} speech tokens, {m.audio_seconds:.2f} s of audio"))
    return 0
