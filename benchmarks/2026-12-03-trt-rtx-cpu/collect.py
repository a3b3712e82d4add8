"""Collect the CPU-only TensorRT-RTX build runs of this folder into results.json + table.md.
Usage: python collect.py [SETS_DIR]   (SETS_DIR: the whole-profile engine sets, /tmp/rtx7/sets on the day)"""
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rtx7/sets"
KEEP = ("profile", "stage", "mode", "dtype", "buckets", "build_ok", "parse_s", "build_s", "plan_mib", "workspace_gb",
        "wall_s", "error")


def runs() -> dict:
    out = {}
    for path in sorted(glob.glob(os.path.join(HERE, "*", "results.jsonl"))):
        name = os.path.basename(os.path.dirname(path))
        out[name] = [{k: r[k] for k in KEEP if k in r} for r in map(json.loads, open(path))]
    return out


def _time_v(err: str) -> dict:
    """Wall time and peak RSS of the whole `trtbuild build` process (GNU time -v), when its log is there."""
    name = os.path.basename(err)[:-4].replace("_dit_stream_fp32", "_dit")
    path = os.path.join(os.path.dirname(err), name + ".err")
    out = {}
    if os.path.isfile(path):
        for ln in open(path, errors="replace"):
            if "Elapsed (wall clock)" in ln:
                m, sec = ln.rsplit(" ", 1)[1].split(":")[-2:]
                out["process_wall_s"] = round(int(m) * 60 + float(sec), 1)
            if "Maximum resident set size" in ln:
                out["peak_rss_gib"] = round(int(ln.split()[-1]) / 2**20, 1)
    return out


def whole_plans() -> list:
    """One plan per (profile, stage/mode) with every bucket: `trtbuild build` on the whole profile."""
    out = []
    for mpath in sorted(glob.glob(os.path.join(SETS, "*", "manifest.json"))):
        m = json.load(open(mpath))
        for e in m["engines"]:
            x = e["extra"]
            out.append({"set": os.path.basename(os.path.dirname(mpath)), "stage": e["stage"], "mode": e["mode"],
                        "dtype": e["dtype"], "profiles": len(e["buckets"]), "build_ok": True,
                        "parse_s": round(x["parse_seconds"], 2), "build_s": round(x["seconds"], 1),
                        "plan_mib": round(x["plan_bytes"] / 2**20, 1), "workspace_gb": x.get("workspace_gb"),
                        "library": f"{m['tensorrt_library']} {m['versions'].get('tensorrt')}", "device": m["device"],
                        "runnable_here": x.get("runnable_here"), **_time_v(os.path.dirname(mpath) + ".err")})
    for err in sorted(glob.glob(os.path.join(SETS, "*.err"))):
        name = os.path.basename(err)[:-4]
        if not any(p["set"].startswith(name.replace("_dit", "_dit_stream_fp32")) or p["set"] == name for p in out):
            tail = [ln for ln in open(err, errors="replace").read().splitlines() if "error" in ln.lower()]
            out.append({"set": name, "build_ok": False, "error": tail[-1] if tail else "no manifest"})
    return out


def main():
    res = {"library": "TensorRT-RTX 1.7.1.116 (tensorrt-rtx-cu13-libs + tensorrt-rtx-cu13-bindings cp311, PyPI)",
           "machine": "CPU-only (no GPU, no CUDA driver), 2 shared cores, 23 GB RAM, Python 3.11, torch 2.13.0+cpu, "
                      "onnx 1.23.2, onnxscript 0.7.2",
           "model": "random-full (full-size architecture, seeded random weights)",
           "ran": "none: plans built only (validity INVALID here: no CUDA driver)",
           "per_bucket": runs(), "whole_profile_plans": whole_plans()}
    json.dump(res, open(os.path.join(HERE, "results.json"), "w"), indent=1)
    rows = []
    for run, rs in res["per_bucket"].items():
        for r in rs:
            err = r.get("error", "")
            status = "built" if r.get("build_ok") else f"FAILED: {err[err.find('Error Code'):][:220]}"
            rows.append(f"| {r['profile']} | {r['stage']}/{r['mode']} {r['dtype']} | {' '.join(r['buckets'])} | "
                        f"{r.get('workspace_gb', '')} | {r.get('build_s', '')} | {r.get('plan_mib', '')} | {status} | "
                        f"{run} |")
    with open(os.path.join(HERE, "table.md"), "w") as f:
        f.write("# TensorRT-RTX 1.7.1.116 builds on a CPU-only machine (none has run)\n\n")
        f.write("## One plan per profile and stage (every bucket an optimization profile)\n\n")
        f.write("| set | stage/mode dtype | profiles | workspace GiB | parse s | build s | plan MiB | process wall s | "
                "peak RSS GiB | status |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|\n")
        for p in res["whole_profile_plans"]:
            if p["build_ok"]:
                f.write(f"| {p['set']} | {p['stage']}/{p['mode']} {p['dtype']} | {p['profiles']} | {p['workspace_gb']} "
                        f"| {p['parse_s']} | {p['build_s']} | {p['plan_mib']} | {p.get('process_wall_s', '')} | "
                        f"{p.get('peak_rss_gib', '')} | built |\n")
            else:
                f.write(f"| {p['set']} | | | | | | | | | FAILED: {p['error'][:200]} |\n")
        f.write("\n## Per plan of the split runs (seconds = TensorRT-RTX build call, plan = file size)\n\n")
        f.write("| profile | graph | buckets | workspace GiB | build s | plan MiB | status | run |\n")
        f.write("|---|---|---|---|---|---|---|---|\n")
        f.write("\n".join(rows) + "\n")
    print(open(os.path.join(HERE, "table.md")).read())


if __name__ == "__main__":
    main()
