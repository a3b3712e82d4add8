"""Parse + build the full-size DiT and HiFT through `trtbuild build --backend tensorrt` with TensorRT for RTX, in
parallel jobs under a deadline, and report every (profile, stage, mode, dtype, bucket set): parse ok, build ok,
seconds, plan size. Then try to open one plan with the runtime (on an H200 TensorRT-RTX refuses: compute 9.0).

Jobs, in priority order (each one `trtbuild build --model random-full --profile <one stage/mode/bucket set>`):
  1. exports: per graph (DiT stream/offline x dtypes, HiFT stream/offline), the two end buckets of the first profile
     (smallest and largest) -- this also writes the shared ONNX (--onnx-dir) the later jobs reuse;
  2. the two end buckets of the other profiles;
  3. every remaining bucket, in chunks of --chunk, until --deadline.
A TensorRT-RTX build compiles each optimization profile separately, so the cost is about linear in buckets.
Usage: python benchmarks/trt_rtx_build.py --out DIR [--profiles default,h200-graphs] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import yaml

from cosytrt.runtime.stages.profile import load_profile

# what `trtbuild build` builds (build/engine_set.py EngineSetBuilder.BUILT): HiFT's stream buckets are CUDA graphs of
# the conv stack, not engines, so a hift/stream job would build nothing
GRAPHS = [("dit", "stream"), ("dit", "offline"), ("hift", "offline")]


def job_profile(profile, stage: str, mode: str, dtype: str, buckets, options: dict | None = None) -> dict:
    sp = profile.stage(stage)
    options = options or {}
    lk, mk = ("frames", "min_frames")
    sd = {"dtype": dtype, "options": {**sp.options, **options}, mode: {"buckets": []}}
    if stage == "hift" and dtype != "float32":
        sd["allow_reduced_precision"] = True
    for b in buckets:
        e = {"batch": b.batch, lk: b.length}
        if b.min_length > 1:
            e[mk] = b.min_length
        sd[mode]["buckets"].append(e)
    return {"model": "full", "description": f"{profile.source} {stage}/{mode} {dtype} subset",
            "dtype": dtype, "max_padding_waste": profile.max_padding_waste, "stages": {stage: sd}}


def plan_jobs(args) -> list[dict]:
    profiles = [(p, load_profile(p)) for p in args.profiles.split(",")]
    dtypes = args.dtypes.split(",")
    only = [tuple(g.split("/")) for g in args.graphs.split(",")] if args.graphs else GRAPHS
    graphs = [(s, m, d) for s, m in GRAPHS if (s, m) in only for d in (dtypes if s == "dit" else ["float32"])]
    jobs, rest = [], []
    for pi, (pname, prof) in enumerate(profiles):
        for s, m, d in graphs:
            bks = [b for b in prof.buckets(s, m) if not args.buckets or b.key.split("/")[-1] in args.buckets.split(",")]
            if not bks:
                continue
            ends = [bks[0], bks[-1]] if len(bks) > 1 and args.chunk > 1 else bks[:1]  # --chunk 1: one bucket a plan
            jobs.append(dict(phase=1 if pi == 0 else 2, profile=pname, stage=s, mode=m, dtype=d,
                             buckets=ends, prof=prof))
            middle = [b for b in bks if b not in ends]
            for i in range(0, len(middle), args.chunk):
                rest.append(dict(phase=3, profile=pname, stage=s, mode=m, dtype=d, buckets=middle[i:i + args.chunk],
                                 prof=prof))
    rest.sort(key=lambda j: (j["buckets"][0].batch * j["buckets"][0].length, j["profile"]))
    return jobs + rest


def start(job, k: int, args):
    d = os.path.join(args.work, f"job{k:03d}")
    os.makedirs(d, exist_ok=True)
    yml = os.path.join(d, "profile.yaml")
    with open(yml, "w") as f:
        prof = job_profile(job["prof"], job["stage"], job["mode"], job["dtype"], job["buckets"],
                           _options(args, job["stage"], job["dtype"]))
        yaml.safe_dump(prof, f)
    job["workspace_gb"] = float(prof["stages"][job["stage"]]["options"].get("workspace_gb", 8))
    cmd = [sys.executable, "-m", "cosytrt.tools.trtbuild", "build", "--model", "random-full", "--profile", yml,
           "--backend", "tensorrt", "--device", args.device, "--onnx-dir", args.onnx_dir, "--out",
           os.path.join(d, "set"), "--quiet"]
    job.update(dir=d, cmd=" ".join(cmd), t0=time.time())
    log = open(os.path.join(d, "log.txt"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _options(args, stage: str, dtype: str) -> dict:
    """Builder options over the profile's: --workspace-gb STAGE:DTYPE=GB (e.g. dit:float32=12), --max-threads."""
    out = {}
    for item in args.workspace_gb or []:
        key, gb = item.split("=")
        if key in (stage, f"{stage}:{dtype}"):
            out["workspace_gb"] = float(gb)
    if args.max_threads:
        out["max_threads"] = args.max_threads
    return out


def record(job, rc, args) -> dict:
    out = {k: job[k] for k in ("phase", "profile", "stage", "mode", "dtype")}
    out.update(buckets=[b.key.split("/")[-1] for b in job["buckets"]], rc=rc, workspace_gb=job.get("workspace_gb"),
               wall_s=round(time.time() - job["t0"], 1))
    mpath = os.path.join(job["dir"], "set", "manifest.json")
    m = json.load(open(mpath)) if rc == 0 and os.path.isfile(mpath) else None
    if m is not None and not m["engines"]:
        out.update(build_ok=None, error="nothing built (no engine of this stage/mode in trtbuild build)")
    elif m is not None:
        e = m["engines"][0]
        x = e["extra"]
        out.update(parse_ok=True, build_ok=True, parse_s=round(x["parse_seconds"], 2),
                   build_s=round(x["seconds"], 1), plan_mib=round(x["plan_bytes"] / 2**20, 1),
                   library=f"{m['tensorrt_library']} {m['versions'].get('tensorrt')}",
                   runnable_here=x.get("runnable_here"), not_runnable_reason=x.get("not_runnable_reason"),
                   plan=os.path.join(job["dir"], "set", e["file"]), spec=e)
    else:
        tail = open(os.path.join(job["dir"], "log.txt"), errors="replace").read()[-3000:]
        out.update(parse_ok="could not parse" not in tail if rc is not None else None, build_ok=False,
                   error=tail.strip().splitlines()[-1] if tail.strip() else "", log_tail=tail)
    return out


def refusal_check(res: dict) -> str:
    """Open one built plan with the runtime's TensorRTRunner (what a served engine set does)."""
    from cosytrt.engines.base import EngineSpec
    from cosytrt.engines.tensorrt import TensorRTRunner

    spec = EngineSpec.from_dict(res["spec"])
    try:
        TensorRTRunner(res["plan"], spec, "cuda")
        return "opened (unexpected on compute capability 9.0)"
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/trt_rtx_work")
    ap.add_argument("--onnx-dir", default="/tmp/trt_rtx_onnx")
    ap.add_argument("--profiles", default="default,h200-graphs")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--deadline", type=float, default=420.0, help="seconds; unfinished jobs are killed")
    ap.add_argument("--keep-plans", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: TensorRT-RTX builds ahead of time without a GPU")
    ap.add_argument("--graphs", default="", help="subset of " + ",".join(f"{s}/{m}" for s, m in GRAPHS))
    ap.add_argument("--workspace-gb", action="append", help="STAGE[:DTYPE]=GB over the profile's workspace_gb")
    ap.add_argument("--max-threads", type=int, default=None, help="builder threads per job (default: every CPU)")
    ap.add_argument("--buckets", default="", help="only these bucket keys, e.g. b16xt2100")
    ap.add_argument("--no-refusal-check", action="store_true", help="skip opening a plan with the runtime")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_end = time.time() + args.deadline
    jobs = plan_jobs(args)
    print(f"{len(jobs)} jobs, {args.workers} workers, deadline {args.deadline:.0f} s", flush=True)
    results, running, k, refusal = [], {}, 0, None
    pending = list(jobs)
    with open(os.path.join(args.out, "results.jsonl"), "w") as fout:
        ready, failed = set(), set()  # graphs whose phase-1 job (the export) finished / failed

        def key(j):
            return (j["stage"], j["mode"], j["dtype"])

        while (pending or running) and time.time() < t_end:
            for j in [j for j in pending if j["phase"] > 1 and key(j) in failed]:
                pending.remove(j)
                res = {k2: j[k2] for k2 in ("phase", "profile", "stage", "mode", "dtype")}
                res.update(buckets=[b.key.split("/")[-1] for b in j["buckets"]], rc=None, build_ok=None,
                           error="skipped: this graph's export failed")
                results.append(res)
                fout.write(json.dumps(res) + "\n")
            while len(running) < args.workers:
                job = next((j for j in pending if j["phase"] == 1 or key(j) in ready), None)
                if job is None:
                    break
                pending.remove(job)
                running[start(job, k, args)] = job
                k += 1
            time.sleep(1)
            for p in [p for p in running if p.poll() is not None]:
                res = record(running.pop(p), p.returncode, args)
                if res["phase"] == 1:  # later jobs of this graph need its export, not this job's build
                    stamp = os.path.join(args.onnx_dir, "{}_{}_{}.onnx.json".format(*key(res)))
                    (ready if os.path.isfile(stamp) else failed).add(key(res))
                if refusal is None and res.get("build_ok") and not args.no_refusal_check:
                    refusal = refusal_check(res)
                    print("refusal check:", refusal, flush=True)
                if not args.keep_plans and res.get("plan") and os.path.isfile(res["plan"]):
                    os.remove(res["plan"])
                res.pop("spec", None)
                results.append(res)
                fout.write(json.dumps(res) + "\n")
                fout.flush()
                print(json.dumps({k2: v for k2, v in res.items() if k2 not in ("log_tail", "not_runnable_reason")}),
                      flush=True)
        for p, job in running.items():  # deadline
            os.killpg(p.pid, signal.SIGKILL)
            res = {k2: job[k2] for k2 in ("phase", "profile", "stage", "mode", "dtype")}
            res.update(buckets=[b.key.split("/")[-1] for b in job["buckets"]], rc=None, build_ok=None,
                       error="killed at the deadline", wall_s=round(time.time() - job["t0"], 1))
            results.append(res)
            fout.write(json.dumps(res) + "\n")
        for job in pending:
            res = {k2: job[k2] for k2 in ("phase", "profile", "stage", "mode", "dtype")}
            res.update(buckets=[b.key.split("/")[-1] for b in job["buckets"]], rc=None, build_ok=None,
                       error="not started (deadline)")
            results.append(res)
            fout.write(json.dumps(res) + "\n")
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(f"refusal check: {refusal}\n\n")
        f.write("| profile | stage/mode | dtype | buckets | parse | build | parse s | build s | plan MiB | note |\n")
        f.write("|---|---|---|---|---|---|---|---|---|---|\n")
        for r in sorted(results, key=lambda r: (r["profile"], r["stage"], r["mode"], r["dtype"])):
            f.write(f"| {r['profile']} | {r['stage']}/{r['mode']} | {r['dtype']} | {' '.join(r['buckets'])} | "
                    f"{r.get('parse_ok')} | {r.get('build_ok')} | {r.get('parse_s', '')} | {r.get('build_s', '')} | "
                    f"{r.get('plan_mib', '')} | {r.get('error', '')[:200]} |\n")
    print(open(os.path.join(args.out, "summary.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
