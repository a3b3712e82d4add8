"""`trtbuild coverage`: how a workload's stage calls fit the buckets, from a replay or a shape-only simulation.

`--engines DIR`: replay the workload through the runtime with that engine set and record every bucketed call.
`--simulate`: no model and no engines: simulate the calls (tools/coverage_sim.py: the hop schedule, the scheduler's
batching policies, a clock model of the full-size model) and rate them against `--profile` (default h200-graphs).

Workload: `--workload FILE` (JSONL, fields in cosytrt.tools.coverage_workload), `--matrix default` (text short /
medium / long x stream / offline x reference audio yes / no x concurrency 1 / 8 / 32; `--quick` or `--scale F` keep
CPU runs small) or `--open-loop rate=8,duration=30,seed=0` (real traffic: Poisson arrivals submitted at their times,
log-normal mixed lengths around 8 s, 2-40 s; optional keys stream, lengths, min, max as in `trtbuild bench --suite
open_loop`; with --simulate, `--rates 4,8,16` adds the same traffic at other rates).
Prints per stage: bucket hit rate, and per bucket: calls, share of calls and work, padding waste (mean, p95, max),
eager fallbacks with their share of time, and the extra buckets that would remove the fallbacks or cut the waste.
`--derive-profile OUT.yaml` writes a profile derived from the call shapes (tools/coverage_profile.py; at most
`--max-buckets` per stage/mode) and prints the hit rates of the old and the derived profile on the same calls.
`--out DIR` writes report.json and heatmap.png there (with --derive-profile also hit_rates.png, heatmap_derived.png).
`--cached-hops` (with --simulate): simulate the runtime's defaults where the profile has a cached-hop grid (flow prefix
cache, saved-voice prompt cache, Euler-step DiT scheduling): streaming hops become cached-hop calls (requests, new
frames, prefix frames) rated against the profile's `dit.cached` grid (hit rate, padded work, graphs) and, with
--derive-profile, a `dit.cached` grid derived from them (at most `--max-cached-graphs` graphs).
"""
from __future__ import annotations

import json
import os

from ._cli import add_device, check_file_out
from .table import format_table


def add_arguments(p) -> None:
    p.add_argument("--engines", default=None, help="engine-set folder (with manifest.json); not with --simulate")
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
    p.add_argument("--simulate", action="store_true",
                   help="shape-only: simulate the calls (hop schedule, batching policies, a clock model; no model, no "
                        "engines) and rate them against --profile")
    p.add_argument("--profile", default=None,
                   help="the profile to rate simulated calls against and to derive from (default h200-graphs)")
    p.add_argument("--rates", default=None, help="with --simulate --open-loop: simulate these rates too, e.g. 4,8,16")
    p.add_argument("--plus-matrix", action="store_true",
                   help="with --open-loop: the built-in matrix's waves too (each cell its own run), so a derived "
                        "profile serves both kinds of traffic")
    p.add_argument("--prompt-tokens", type=int, default=75, help="with --simulate: the voice's prompt speech tokens")
    p.add_argument("--derive-profile", default=None, metavar="OUT.yaml",
                   help="write a profile derived from the call shapes; compare hit rates old vs derived")
    p.add_argument("--max-buckets", type=int, default=32, help="with --derive-profile: buckets per stage/mode")
    p.add_argument("--cached-hops", action="store_true",
                   help="with --simulate: prefix-cached streaming hops and step-level DiT (the runtime's defaults "
                        "with a cached-hop grid), rated against and derived into dit.cached")
    p.add_argument("--cached-from", default=None, metavar="RESULTS.json",
                   help="with --cached-hops: rate and derive dit.cached from the cached-hop call shapes a GPU run "
                        "recorded (`trtbuild bench --suite open_loop` results.json, all its cells) instead of the "
                        "simulated ones")
    p.add_argument("--max-cached-graphs", type=int, default=64,
                   help="with --cached-hops --derive-profile: most cached-hop graphs (batch x frames x prefix)")


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
    if r.get("dit_cached"):
        c = r["dit_cached"]
        out.append(f"\ndit/cached (prefix-cached hops, one call per Euler step): {c['calls']} calls, bucket hit rate "
                   f"{_f(100 * c['hit_rate'], '.1f')}% in {c['graphs']} graphs {c['grid']}, padded work "
                   f"x{_f(c['work_ratio'])}; requests per call {c['requests']}, new frames {c['new_frames']}, "
                   f"prefix frames p50 {c['prefix']['p50']} p95 {c['prefix']['p95']} max {c['prefix']['max']}")
    if r.get("heatmap"):
        out.append(f"\nheatmap: {r['heatmap']}")
    return "\n".join(out)


def _workload(args):
    from dataclasses import replace

    from ..engines.errors import InputError
    from .coverage_workload import default_matrix, load_workload, open_loop_workload

    if args.workload:
        return load_workload(args.workload), args.workload
    if args.open_loop:
        from .bench.workload import parse_open_loop

        spec = parse_open_loop(args.open_loop)
        if args.rates and args.simulate:
            try:
                rates = [float(x) for x in args.rates.split(",") if x.strip()]
            except ValueError:
                raise InputError(f"--rates {args.rates!r}: give numbers separated by commas, e.g. 4,8,16") from None
            reqs = [replace(r, group=f"open-loop {rate:g}") for rate in rates
                    for r in open_loop_workload(spec.at_rate(rate))]
            reqs, source = reqs, f"open loop {args.open_loop} at rates {args.rates} (one after another)"
        else:
            reqs, source = open_loop_workload(spec), f"open loop {args.open_loop}"
        if args.plus_matrix:
            reqs += default_matrix(args.scale, quick=args.quick)
            source += " plus the default matrix"
        return reqs, source
    reqs = default_matrix(args.scale, quick=args.quick)
    return reqs, ("matrix default" + (" (quick)" if args.quick else "") + (f" x{args.scale:g}" if args.scale != 1
                                                                           else ""))


def _simulate(args, reqs, source: str) -> tuple[dict, list, object, str, list]:
    """(report, unrated calls, old profile, its label, cached-hop calls) of a shape-only run."""
    from ..runtime.stages.profile import load_profile
    from .coverage_derive import tables_of
    from .coverage_plot import write_heatmap
    from .coverage_report import build_report
    from .coverage_sim import CachedHops, rate_calls, simulate

    label = args.profile or "h200-graphs"
    base = load_profile(label)
    runs: dict = {}  # one simulated run per group: an open-loop rate, or a matrix cell submitted at t = 0
    for r in reqs:
        runs.setdefault(r.group, []).append(r)
    grid = base.cached_grid
    calls, cached_calls = [], []
    for group in runs.values():
        ch = CachedHops(cap=max(grid.batch) if grid is not None else 8) if args.cached_hops else None
        calls += simulate(group, args.prompt_tokens, cached=ch)
        cached_calls += ch.calls if ch is not None else []
    if args.cached_from:
        cached_calls = recorded_cached_calls(args.cached_from)
    tables = tables_of(base)
    meta = {"engines": f"profile {label}", "backend": "shape-only simulation", "device": "none", "simulated": True,
            "model": base.model, "max_padding_waste": base.max_padding_waste,
            "workload": {"source": source, "requests": len(reqs), "groups": 1, "wall_seconds": 0.0, "failed": []}}
    report = build_report(rate_calls(calls, tables), tables, meta)
    if args.cached_hops:
        report["dit_cached"] = cached_summary(cached_calls, grid)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        report["heatmap"] = os.path.basename(write_heatmap(report, tables, os.path.join(args.out, "heatmap.png")))
    return report, calls, base, label, cached_calls


def recorded_cached_calls(path: str) -> list[tuple]:
    """(requests, new frames, prefix frames) per cached-hop call recorded by an open-loop bench run (results.json:
    each cell's `cached_hops.shapes` {"b,n,p": calls}), all cells together."""
    from ..engines.errors import InputError

    try:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"coverage: cannot read {path}: {e}") from None
    cells = ((res.get("open_loop") or {}).get("cells") or []) if isinstance(res, dict) else []
    out: list[tuple] = []
    for c in cells:
        for key, n in (((c or {}).get("cached_hops") or {}).get("shapes") or {}).items():
            try:
                b, new, p = (int(v) for v in key.split(","))
            except ValueError:
                raise InputError(f"coverage: {path}: a cached-hop shape {key!r} is not 'requests,frames,prefix'") \
                    from None
            out += [(b, new, p)] * int(n)
    if not out:
        raise InputError(f"coverage: {path} holds no cached-hop call shapes (an open-loop bench run with the flow "
                         "prefix cache and cached-hop graphs records them)")
    return out


def cached_summary(cached_calls: list[tuple], grid) -> dict:
    """Cached-hop calls against `grid`: rate_cached's numbers plus the shapes seen (requests, new frames, prefix
    quantiles)."""
    from collections import Counter

    from .coverage_sim import rate_cached

    out = rate_cached(cached_calls, grid)
    prefixes = sorted(p for _, _, p in cached_calls)
    q = (lambda f: prefixes[min(len(prefixes) - 1, int(f * len(prefixes)))]) if prefixes else (lambda f: None)
    out.update(grid=grid.to_dict() if grid is not None else None,
               requests=dict(sorted(Counter(b for b, _, _ in cached_calls).items())),
               new_frames=dict(sorted(Counter(n for _, n, _ in cached_calls).items())),
               prefix={"p50": q(0.5), "p95": q(0.95), "max": prefixes[-1] if prefixes else None})
    return out


def run(args) -> int:
    from ..engines.errors import InputError

    if args.simulate == bool(args.engines):
        raise InputError("coverage: give --engines DIR (replay through the runtime) or --simulate (shape-only)")
    if args.cached_hops and not args.simulate:
        raise InputError("coverage: --cached-hops goes with --simulate (a replay records the runtime's own calls)")
    if args.cached_from and not args.cached_hops:
        raise InputError("coverage: --cached-from goes with --simulate --cached-hops")
    if args.plus_matrix and not args.open_loop:
        raise InputError("coverage: --plus-matrix goes with --open-loop (the matrix alone is --matrix default)")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):  # checked before the run, not after
        raise InputError(f"coverage: --out {args.out!r} exists and is not a folder")
    if args.derive_profile:
        check_file_out(args.derive_profile, "--derive-profile")
    reqs, source = _workload(args)
    cached_calls: list = []
    if args.simulate:
        report, calls, base, label, cached_calls = _simulate(args, reqs, source)
    else:
        from .coverage_run import run_coverage

        report = run_coverage(args.engines, reqs, model=args.model, device=args.device, out_dir=args.out,
                              source=source, timeout_s=args.timeout, progress=not args.quiet and not args.json,
                              waste_target=args.waste_target or None)
    extra = ""
    if args.derive_profile:
        extra = _derive(args, report, calls if args.simulate else None, base if args.simulate else None,
                        label if args.simulate else None, source, cached_calls)
    if args.out:
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report) + extra)
    return 0


def _derive(args, report: dict, calls, base, label, source: str, cached_calls: list | None = None) -> str:
    from .coverage_derive import calls_from_shapes, derive_and_compare, format_comparison, tables_of

    if base is None:
        from ..engines.manifest import Manifest
        from ..runtime.stages.profile import profile_from_dict

        base = profile_from_dict(Manifest.load(args.engines).profile, f"{args.engines} (manifest profile)")
        label = f"engine set {os.path.basename(os.path.normpath(args.engines))}"
        calls = calls_from_shapes(report["shapes"])
        how = f"the calls recorded by replaying {source} through {args.engines}"
    else:
        how = (f"a shape-only simulation (tools/coverage_sim.py: hop schedule, the scheduler's batching policies with "
               f"the default SchedulerConfig, SimCosts clock) of {source}, prompt {args.prompt_tokens} speech tokens "
               + ("(the runtime's defaults with a cached-hop grid: streaming hops prefix-cached, the saved voice's "
                  "prompt cached after its first stream, Euler-step DiT scheduling; dit.cached derived from the "
                  "cached-hop calls, dit/offline from the finals' per-step calls, dit/stream kept from the base "
                  "profile: only hops the prefix cache cannot serve use it)" if args.cached_hops else
                  "(dit/stream: whole-history hops, as with flow_prefix_cache off; prefix-cached hops run in the "
                  "dit.cached grid, kept from the base profile)"))
        workload = (f"--open-loop {args.open_loop}" + (f" --rates {args.rates}" if args.rates else "")
                    + (" --plus-matrix" if args.plus_matrix else "")
                    if args.open_loop else f"--workload {args.workload}" if args.workload else "--matrix default")
        if args.cached_from:
            how += f"; dit.cached from the cached-hop calls recorded in {args.cached_from} instead"
        how += (f".\nCommand: trtbuild coverage --simulate {workload} --profile {label} --prompt-tokens "
                f"{args.prompt_tokens}" + (f" --cached-hops --max-cached-graphs {args.max_cached_graphs}"
                                           if args.cached_hops else "")
                + (f" --cached-from {args.cached_from}" if args.cached_from else "")
                + f" --derive-profile {args.derive_profile} --max-buckets {args.max_buckets}")
    res = derive_and_compare(calls, base, label, args.derive_profile, args.max_buckets, how, args.simulate,
                             cached_calls or None, args.max_cached_graphs)
    report["profile_comparison"] = res
    text = format_comparison(res["comparison"]) + f"\nderived profile: {res['profile']}"
    if args.out:
        from .coverage_plot import plot_provenance, write_heatmap, write_hit_rate_plot
        from .coverage_report import build_report
        from .coverage_sim import rate_calls
        from ..runtime.stages.profile import load_profile

        title = f"bucket hit rates, same calls: {source}\n{plot_provenance(report)}"
        write_hit_rate_plot(res["comparison"], os.path.join(args.out, "hit_rates.png"), title)
        dt = tables_of(load_profile(args.derive_profile))
        dr = build_report(rate_calls(calls, dt), dt, {**report, "engines": f"profile {args.derive_profile}"})
        write_heatmap(dr, dt, os.path.join(args.out, "heatmap_derived.png"))
        text += f"\nplots: {os.path.join(args.out, 'hit_rates.png')}, {os.path.join(args.out, 'heatmap_derived.png')}"
    return text
