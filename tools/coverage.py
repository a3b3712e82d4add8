"""`trtbuild coverage --engines DIR`: replay a workload through the runtime and report how its calls fit the buckets.

Workload: `--workload FILE` (JSONL, fields in cosytrt.tools.coverage_workload), `--matrix default` (text short /
medium / long x stream / offline x reference audio yes / no x concurrency 1 / 8 / 32; `--quick` or `--scale F` keep
CPU runs small) or `--open-loop rate=8,duration=30,seed=0` (real traffic: Poisson arrivals submitted at their times, log-normal
mixed lengths around 8 s, 2-40 s; optional keys stream, lengths, min, max as in `trtbuild bench --suite open_loop`).
Prints per stage: bucket hit rate, and per bucket: calls, share of calls and work, padding waste (mean, p95, max),
eager fallbacks with their share of time, and the extra buckets that would remove the fallbacks or cut the waste.
`--out DIR` writes report.json and heatmap.png there.
"""
from __future__ import annotations

import json

from ._cli import add_device
from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--engines", required=True, help="engine-set folder (with manifest.json)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, help="workload JSONL (one request per line)")
    src.add_argument("--matrix", default=None, choices=["default"], help="the built-in request matrix (default)")
    src.add_argument("--open-loop", default=None, metavar="SPEC",
                     help="generated open-loop traffic, e.g. rate=8,duration=30,seed=0[,stream=0.8][,lengths=8:0.6]"
                          "[,min=2][,max=40]: Poisson arrivals, mixed lengths, submitted at their arrival times")
    p.add_argument("--quick", action="store_true", help="small matrix: concurrency 1/2/4, 30-100 speech tokens")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the matrix concurrency and speech tokens")
    p.add_argument("--out", default=None, help="report folder: report.json and heatmap.png")
    p.add_argument("--model", default=None, help="'tiny' or a model directory (default: the manifest's model)")
    add_device(p, default=None, help_extra=" (default: the manifest's device)")
    p.add_argument("--waste-target", type=float, default=1.25,
                   help="suggest buckets that cut the padding of calls above this waste (0: do not)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for one request")
    p.add_argument("--json", action="store_true", help="print the report JSON instead of the tables")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _f(v, fmt=".3f"):
    return "-" if v is None else format(v, fmt)


def mostly_fallback_note(r: dict, threshold: float = 0.5) -> list[str]:
    """When most calls fell back to eager: why (the reasons, largest first) and what to try."""
    t = r["totals"]
    if not t["calls"] or t["fallbacks"] / t["calls"] <= threshold:
        return []
    reasons: dict[str, int] = {}
    for sm, st in r["stages"].items():
        if not st.get("has_engine", True):
            reasons[f"{sm}: no engine in this set"] = reasons.get(f"{sm}: no engine in this set", 0) + st["fallbacks"]
            continue
        for e in st["fallback_shapes"]:
            key = f"{sm}: {e['reason']}"
            reasons[key] = reasons.get(key, 0) + e["count"]
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:4]
    lines = [f"\nmost calls ran eagerly ({t['fallbacks']} of {t['calls']}, {100 * t['fallbacks'] / t['calls']:.0f}%); "
             f"why: " + "; ".join(f"{k} ({n} calls)" for k, n in top)]
    src = r["workload"]["source"]
    if "quick" not in src and not src.endswith(".jsonl"):
        lines.append("the default matrix (long texts, concurrency up to 32) is sized for a full profile: on a small "
                     "set (e.g. profiles/tiny.yaml) run `trtbuild coverage --quick`, or add the suggested buckets")
    else:
        lines.append("add the suggested buckets to the profile and rebuild (`trtbuild build`)")
    return lines


def format_report(r: dict) -> str:
    out = []
    w = r["workload"]
    t = r["totals"]
    out.append(f"coverage of {r['engines']} ({r['backend']}, {r['device']}): {w['requests']} requests in "
               f"{w['groups']} groups from {w['source']}, {w['wall_seconds']:.1f} s; {t['calls']} stage calls, "
               f"{t['fallbacks']} eager fallbacks (max padding waste {r['max_padding_waste']:g})")
    for sm, st in r["stages"].items():
        rows = []
        for b in st["buckets"]:
            rows.append([b["key"], b["calls"], _f(100 * b["share_of_calls"], ".1f"),
                         _f(100 * b["share_of_work"], ".1f"), _f(b["waste"]["mean"]), _f(b["waste"]["p95"]),
                         _f(b["waste"]["max"]), _f(b["seconds"]), ""])
        time_share = 100 * st["fallback_time_share"]
        calls_pct = 100 * st["fallbacks"] / st["calls"] if st["calls"] else 0.0
        rows.append(["eager fallback", st["fallbacks"], _f(calls_pct, ".1f"),
                     _f(100 * st["fallback_work_share"], ".1f"), "-", "-", "-", _f(st["fallback_seconds"]),
                     _f(time_share, ".1f")])
        hits = st.get("hits", st["calls"] - st["fallbacks"])
        hit = f", bucket hit rate {100 * hits / st['calls']:.1f}%" if st["calls"] else ""
        title = (f"\n{sm}: {st['calls']} calls{hit}, padding waste mean {_f(st['waste']['mean'])} p95 "
                 f"{_f(st['waste']['p95'])} max {_f(st['waste']['max'])}"
                 + ("" if st["has_engine"] else " (no engine in this set: every call runs eagerly)"))
        out.append(format_table(["bucket", "calls", "calls %", "work %", "waste mean", "p95", "max", "seconds",
                                 "time %"], rows, title=title))
    fb_rows = [[sm, e["b"], e["n"], e["count"], e["reason"], _f(e["seconds"]), e["suggested_bucket"] or "-"]
               for sm, st in r["stages"].items() for e in st["fallback_shapes"]]
    if fb_rows:
        out.append("")
        out.append(format_table(["stage/mode", "batch", "length", "calls", "reason", "seconds", "suggested bucket"],
                                fb_rows, title="eager fallbacks"))
    lines = []
    for sm, s in r["suggestions"].items():
        if s["fallback_buckets"]:
            keys = ", ".join(x["key"] for x in s["fallback_buckets"])
            n = sum(x["covers_calls"] for x in s["fallback_buckets"])
            lines.append(f"  {sm}: add {keys} (removes {n} fallback calls)")
        if s["uncovered"]:
            lines.append(f"  {sm}: no bucket within the waste limit for shapes {s['uncovered']}")
        for x in s["waste_buckets"]:
            lines.append(f"  {sm}: add {x['key']} to cut padded work by {100 * x['saved_share']:.1f}% "
                         f"({x['calls']} calls)")
    out.append("\nsuggested buckets:" if lines else "\nsuggested buckets: none (no fallbacks, waste within target)")
    out += lines
    out += mostly_fallback_note(r)
    if w["failed"]:
        out.append(f"\n{len(w['failed'])} request(s) failed, first: {w['failed'][0]['group']}: "
                   f"{w['failed'][0]['error']}")
    if r.get("heatmap"):
        out.append(f"\nheatmap: {r['heatmap']}")
    return "\n".join(out)


def run(args) -> int:
    from .coverage_run import run_coverage
    from .coverage_workload import default_matrix, load_workload

    if args.workload:
        reqs, source = load_workload(args.workload), args.workload
    elif args.open_loop:
        from .bench.workload import parse_open_loop
        from .coverage_workload import open_loop_workload

        spec = parse_open_loop(args.open_loop)
        reqs, source = open_loop_workload(spec), f"open loop {args.open_loop}"
    else:
        reqs = default_matrix(args.scale, quick=args.quick)
        source = ("matrix default" + (" (quick)" if args.quick else "")
                  + (f" x{args.scale:g}" if args.scale != 1 else ""))
    report = run_coverage(args.engines, reqs, model=args.model, device=args.device, out_dir=args.out, source=source,
                          timeout_s=args.timeout, progress=not args.quiet and not args.json,
                          waste_target=args.waste_target or None)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0
