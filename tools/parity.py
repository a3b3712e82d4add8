"""`trtbuild parity --engines DIR`: every engine and bucket against the eager models, and pipeline-level checks.

Exit status 0 when every check passes, 1 when any fails (each failure is printed with what broke), 2 on bad input.
`--json` prints the report documented in cosytrt.build.parity instead of the tables.
"""
from __future__ import annotations

import json

from ._cli import add_device
from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--engines", required=True, help="engine-set folder (with manifest.json)")
    p.add_argument("--model", default=None, help="'tiny', 'random-full' or a model directory (default: the "
                                                 "manifest's model)")
    add_device(p, default=None, help_extra=" (default: the manifest's device)")
    p.add_argument("--json", action="store_true", help="print the JSON report")
    p.add_argument("--seed", type=int, default=0, help="seed of the test inputs and of the pipeline request")
    p.add_argument("--no-pipeline", action="store_true", help="skip the pipeline-level checks")
    p.add_argument("--no-polygraphy", action="store_true", help="skip the Polygraphy Comparator runs")
    p.add_argument("--stream-tokens", type=int, default=80, help="speech tokens of the streaming pipeline request")
    p.add_argument("--prompt-seconds", type=float, default=1.0, help="prompt audio of the pipeline request (s)")
    p.add_argument("--ignore-weights-hash", action="store_true",
                   help="check a set whose manifest names other model weights (diagnosis only)")


def _num(v, fmt: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return format(v, fmt)


def format_report(report) -> str:
    from ..build.parity_metrics import THRESHOLDS

    rows = []
    for c in report.checks:
        m = c.metrics
        rows.append([c.name, c.dtype or "-", _num(m.get("max_abs_err"), ".2e"), _num(m.get("max_rel_err"), ".2e"),
                     _num(m.get("cosine"), ".6f"), _num(m.get("snr_db"), ".1f"), "ok" if c.passed else "FAIL"])
    out = [format_table(["check", "dtype", "max abs", "max rel", "cosine", "SNR dB", "result"], rows,
                        title=f"parity of {report.engines} ({report.backend}, {report.device}) vs eager "
                              f"{report.model}")]
    f32, red = THRESHOLDS["float32"], THRESHOLDS["float16"]
    out.append(f"thresholds: float32: DiT max |err| <= {f32['dit_max_abs']:g}, HiFT wav max |err| <= "
               f"{f32['hift_max_abs']:g} (golden README), pipeline audio SNR >= {f32['pipeline_min_snr_db']:g} dB; "
               f"float16/bfloat16: SNR >= {red['min_snr_db']:g} dB and cosine >= {red['min_cosine']:g}, pipeline "
               f"audio SNR >= {red['pipeline_min_snr_db']:g} dB")
    notes = [c for c in report.checks if c.note and c.passed and c.kind != "polygraphy"]
    for c in notes:
        out.append(f"note  {c.name}: {c.note}")
    for c in report.failed:
        out.append(f"FAIL  {c.name}: {c.note or c.rule}")
    out.append(summary_line(report))
    out.append(f"PASS ({len(report.checks)} of {len(report.checks)} checks)" if report.passed
               else f"FAIL ({len(report.failed)} of {len(report.checks)} checks)")
    return "\n".join(out)


def summary_line(report) -> str:
    """`summary: N checks: P passed (S skipped), F failed; by kind: engine a/b, polygraphy c/d, ...`."""
    from collections import Counter

    skipped = sum(1 for c in report.checks if c.passed and "skipped" in (c.note or ""))
    total, ok = Counter(), Counter()
    for c in report.checks:
        total[c.kind] += 1
        ok[c.kind] += bool(c.passed)
    kinds = ", ".join(f"{k} {ok[k]}/{total[k]}" for k in total)
    n, failed = len(report.checks), len(report.failed)
    return (f"summary: {n} checks: {n - failed} passed" + (f" ({skipped} skipped)" if skipped else "")
            + f", {failed} failed" + (f"; passed by kind: {kinds}" if kinds else ""))


def run(args) -> int:
    import math

    from ..build.parity import ParityChecker, run_parity
    from ..engines.errors import InputError
    from ..engines.manifest import Manifest
    from ..runtime.models.frontend import MAX_PROMPT_SECONDS

    # bad request options are usage errors (exit 2), not a failed pipeline check after every engine check ran
    if args.stream_tokens < 1:
        raise InputError(f"--stream-tokens must be >= 1, got {args.stream_tokens}")
    if not (math.isfinite(args.prompt_seconds) and 0 < args.prompt_seconds <= MAX_PROMPT_SECONDS):
        raise InputError(f"--prompt-seconds must be in (0, {MAX_PROMPT_SECONDS:g}], got {args.prompt_seconds}")
    kw = dict(check_weights=not args.ignore_weights_hash, seed=args.seed, polygraphy=not args.no_polygraphy,
              pipeline=not args.no_pipeline, stream_tokens=args.stream_tokens, prompt_seconds=args.prompt_seconds)
    man = Manifest.load(args.engines)
    if (args.model or man.model.get("source")) == "random-full":  # `trtbuild build --model random-full` sets
        from .build_cmd import random_full_models

        device = args.device or man.device
        report = ParityChecker(random_full_models(device), args.engines, device, **kw).run()
    else:
        report = run_parity(args.engines, model=args.model, device=args.device, **kw)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_report(report))
    return 0 if report.passed else 1
