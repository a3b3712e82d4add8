"""`trtbuild bench` / `python -m cosytrt.tools.bench`: the suites on the full-size CosyVoice3 architecture (seeded
random weights, forced lengths); each section writes OUT/results.json as it finishes, so a run cut short keeps what
it measured. Everything runs with what the GPU machine has (torch, numpy); other imports are guarded.

Suites: micro (= ar, dit, hift), parity, e2e (micro.py); serving, features (serving.py); open_loop (open_loop.py);
agent (agent.py: voice-agent websocket sessions).
"""
from __future__ import annotations

import argparse
import os

import torch

from .common import DTYPES, VARIANTS, Bench, full_models, log

SUITES = ("micro", "ar", "dit", "hift", "parity", "e2e", "serving", "features", "open_loop", "agent")


def add_arguments(p) -> None:
    p.add_argument("--suite", default="micro,parity,e2e,serving,features",
                   help="comma list of micro (= ar, dit, hift), parity, e2e, serving, features, open_loop, agent")
    p.add_argument("--out", required=True, help="folder for results.json (and plots)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="full", help="'full' (random full-size weights) or 'tiny'")
    p.add_argument("--dtype", default="bfloat16", help="LM and DiT dtype (HiFT stays float32)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (serving: the quick cells)")
    p.add_argument("--cells", default=None, choices=["full", "quick", "smoke"],
                   help="serving cell set (default: full, or quick with --quick; smoke: a CPU check of the harness)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new sections after this many seconds")
    p.add_argument("--graph-profile", default="h200-graphs", help="bucket profile of the CUDA graphs (serving)")
    p.add_argument("--engines", default=None,
                   help="engine set for the 'engines' serving variant (built from the same seeded weights: "
                        "trtbuild build --model random-full, or the tiny bench weights)")
    p.add_argument("--variants", default="compiled,graphs,eager",
                   help="serving variants (the first runs the whole matrix, the others the comparison cells); "
                        "open_loop runs on the first")
    p.add_argument("--no-compile", action="store_true", help="micro: skip the torch.compile variants")
    p.add_argument("--aoti", action="store_true", help="micro: also build and time an AOTInductor DiT on CUDA")
    p.add_argument("--compile-cache", default=None,
                   help="file of torch.compile artifacts: loaded first if it exists, (re)written at the end")
    g = p.add_argument_group("open_loop suite (Poisson arrivals, mixed lengths)")
    g.add_argument("--rates", default="4,8,16,24", help="arrival rates in requests/s, swept upwards until saturation")
    g.add_argument("--duration-s", type=float, default=20.0, help="seconds of arrivals per cell")
    g.add_argument("--drain-s", type=float, default=15.0,
                   help="after the arrivals, wait this long for requests in flight, then cancel them (unfinished)")
    g.add_argument("--seed", type=int, default=0, help="arrival / length / mode seed")
    g.add_argument("--stream-fraction", default="1",
                   help="share of streaming requests; a comma list (e.g. 1,0: all streams, then all offline) runs "
                        "each setting's rate sweep once per share, one process (the streaming vs offline saturation "
                        "of the same mix in one set-up)")
    g.add_argument("--lengths", default="8:0.6",
                   help="audio-length mix: MEDIAN_S:SIGMA[:WEIGHT] log-normal components joined by '+'")
    g.add_argument("--min-s", type=float, default=2.0, help="shortest request, audio seconds (25 tokens = 1 s)")
    g.add_argument("--max-s", type=float, default=40.0, help="longest request, audio seconds")
    g.add_argument("--sample-stacks", action="store_true",
                   help="sample the scheduler threads' Python stacks during each cell (where the time goes)")
    g.add_argument("--kernel-profile-s", type=float, default=0.0, metavar="S",
                   help="CUDA only: a torch.profiler window of S seconds from the middle of each cell's arrivals, "
                        "summarised per launching worker, stream and kernel (tools/bench/kernel_profile.py); the "
                        "profiler's host cost makes that cell's latencies pessimistic")
    g.add_argument("--kernel-trace", action="store_true",
                   help="with --kernel-profile-s: also keep each window's Chrome trace, gzipped, in the output folder")
    g.add_argument("--ab", default="", help="comma list of settings: a SchedulerConfig boolean field (A+B: several "
                                            "together) runs each rate with it off and on; NAME=VALUE[+NAME=VALUE] "
                                            "is one setting with those boolean, numeric or string values (e.g. "
                                            "dit_max_requests=16; max_in_flight=24+on_full=reject sheds load: with "
                                            "on_full=wait a full TTS would hold the arrival timer); unusable items are "
                                            "skipped with a message")
    g.add_argument("--keep-alive", default=None, metavar="DIR",
                   help="open_loop: after the pipeline's set-up, run the jobs queued as DIR/queue/ID.json (each a "
                        "JSON list of open-loop flags: --rates, --ab, ...) over the same pipeline, results in "
                        "DIR/done/ID/, until idle for --keep-alive-idle-s (this run's own --rates / --ab are not run; "
                        "benchmarks/bench_job.sh queues jobs across device calls)")
    g.add_argument("--keep-alive-idle-s", type=float, default=600.0, help="with --keep-alive: stop after this long "
                   "without a job")
    g = p.add_argument_group("agent suite (voice-agent websocket sessions, Poisson arrivals)")
    g.add_argument("--agent-rates", default="0.5,1,2", help="session arrival rates (sessions/s)")
    g.add_argument("--agent-duration-s", type=float, default=20.0, help="seconds of session arrivals per cell")
    g.add_argument("--agent-settings", default="ws_lookahead=0+ws_buffer_hints=0,ws_lookahead=0+ws_buffer_hints=1,"
                                                "ws_lookahead=1+ws_buffer_hints=1",
                   help="server settings to compare, comma-separated, each NAME=N[+NAME=N] (int / bool fields)")
    g.add_argument("--agent-words-per-s", type=float, default=12.0, help="the simulated LLM's text speed")


def _open_loop_spec(args):
    from ...engines.errors import InputError
    from .workload import OpenLoopSpec, parse_lengths

    try:
        rates = sorted(float(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        raise InputError(f"--rates {args.rates!r}: a comma list of requests per second") from None
    if not rates or min(rates) <= 0:
        raise InputError(f"--rates {args.rates!r}: give positive rates")
    if args.drain_s < 0:
        raise InputError("--drain-s must be >= 0")
    try:
        fractions = [float(f) for f in str(args.stream_fraction).split(",") if f.strip()]
    except ValueError:
        raise InputError(f"--stream-fraction {args.stream_fraction!r}: a share in [0, 1] or a comma list") from None
    if not fractions:
        raise InputError("--stream-fraction: give a share in [0, 1]")
    specs = [OpenLoopSpec(rates[0], args.duration_s, args.seed, f, parse_lengths(args.lengths), args.min_s, args.max_s)
             for f in fractions]   # each checks its share
    return specs, rates, [f.strip() for f in args.ab.split(",") if f.strip()]


class _JobArgumentError(ValueError):
    """A keep-alive job's flags do not parse (argparse would exit the process that serves the next job)."""


class _JobParser(argparse.ArgumentParser):
    def error(self, message):
        raise _JobArgumentError(message)


def job_parser(boot):
    """`JobQueue`'s parse: a job's open-loop flags -> (args, specs, rates, ab), its output in `out`; the device,
    model, dtype, graph profile, engines and variant are the serving process's (`boot`), whatever the job says. The
    first job that parses saves the process's compile cache once its first scheduler is ready (as a run without
    --keep-alive does)."""
    cache = {"path": getattr(boot, "compile_cache", None)}

    def parse(flags: list[str], out: str):
        p = _JobParser(prog="bench job", add_help=False)
        add_arguments(p)
        args = p.parse_args(list(flags) + ["--out", out, "--suite", "open_loop"])
        for name in ("device", "model", "dtype", "graph_profile", "engines", "variants"):
            setattr(args, name, getattr(boot, name))
        args.keep_alive = None
        specs, rates, ab = _open_loop_spec(args)
        args.compile_cache, cache["path"] = cache["path"], None
        return args, specs, rates, ab
    return parse


def run(args) -> int:
    from ...engines.errors import InputError
    from ...runtime.stages.compiled import load_compile_cache

    suites = set(args.suite.split(","))
    if "micro" in suites:
        suites |= {"ar", "dit", "hift"}
    unknown = suites - set(SUITES)
    if unknown:
        raise InputError(f"unknown bench suite(s) {sorted(unknown)}: use micro (= ar, dit, hift), parity, e2e, "
                         "serving, features, open_loop, agent")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise InputError("trtbuild bench --device cuda: no CUDA GPU here")
    if not cuda and suites & {"ar", "dit", "hift", "parity"}:
        raise InputError("the micro (ar, dit, hift) and parity suites time CUDA graphs: they need --device cuda")
    variants = args.variants.split(",")
    bad = set(variants) - set(VARIANTS)
    if bad:
        raise InputError(f"unknown serving variant(s) {sorted(bad)}: use {', '.join(VARIANTS)}")
    if "engines" in variants and not args.engines:
        raise InputError("--variants engines needs --engines DIR")
    open_loop = _open_loop_spec(args) if "open_loop" in suites else None
    cells = args.cells or ("quick" if args.quick else "full")
    dtype = DTYPES[args.dtype]
    b = Bench(args)
    if args.compile_cache and os.path.isfile(args.compile_cache):
        log(f"loading compile cache {args.compile_cache}: {load_compile_cache(args.compile_cache)}")
    log(f"building {args.model} models on {args.device}")
    cfg, llm, flow, hift = full_models(args.device, dtype, args.model)
    compile = not args.no_compile
    aoti = None
    if "dit" in suites and args.aoti:  # started first: its compile overlaps the sections before the DiT one
        import tempfile

        from .aoti import AotiBuild

        # the package holds the weights (hundreds of MB): keep it out of --out
        aoti = AotiBuild(args.model, dtype, args.device, tempfile.mkdtemp(prefix="cosytrt-aoti-"))
        log(f"building the AOTInductor DiT in a child process (log: {aoti.log})")
    if suites & {"ar", "dit", "hift", "parity", "e2e"}:
        from . import micro

        if "ar" in suites:
            b.section("ar", lambda: micro.bench_ar(llm, args.device, args.quick, compile))
        if "dit" in suites:
            b.section("dit", lambda: micro.bench_dit(flow, args.device, dtype, args.quick, compile, aoti))
        if "hift" in suites:
            b.section("hift", lambda: micro.bench_hift(hift, args.device, args.quick, compile))
        if "parity" in suites:
            b.section("graph_parity", lambda: micro.graph_parity(cfg, llm, flow, hift, args.device,
                                                                 args.graph_profile))
        if "e2e" in suites:
            b.section("e2e", lambda: micro.bench_e2e(cfg, llm, flow, hift, args.device, args.quick))
    if open_loop is not None:  # before the serving matrix: the section a run with both is for
        from .open_loop import bench_open_loop

        specs, rates, ab = open_loop
        jobs = None
        if getattr(args, "keep_alive", None):
            from .open_loop import JobQueue

            jobs = JobQueue(args.keep_alive, job_parser(args), args.keep_alive_idle_s)
        b.section("open_loop", lambda: bench_open_loop(cfg, llm, flow, hift, args.device, b, variants[0], specs,
                                                       rates, args.drain_s, ab, jobs))
    if "agent" in suites:
        from .agent import AgentSpec, bench_agent, parse_settings

        try:
            agent_rates = [float(r) for r in args.agent_rates.split(",") if r.strip()]
            agent_settings = parse_settings(args.agent_settings)
        except ValueError as e:
            raise InputError(f"--agent-rates / --agent-settings: {e}") from None
        if not agent_rates or min(agent_rates) <= 0:
            raise InputError("--agent-rates needs positive rates")
        spec = AgentSpec(agent_rates[0], args.agent_duration_s, args.seed, words_per_s=args.agent_words_per_s)
        b.section("agent", lambda: bench_agent(cfg, llm, flow, hift, args.device, b, variants[0], spec,
                                               agent_rates, agent_settings))
    if suites & {"serving", "features"}:
        from .serving import bench_serving

        b.section("serving", lambda: bench_serving(cfg, llm, flow, hift, args.device, b, variants, cells,
                                                   matrix="serving" in suites, features="features" in suites))
    b.results["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
    b.save()
    log(f"wrote {os.path.join(args.out, 'results.json')}")
    return 0


def main(argv: list[str] | None = None) -> int:  # python -m cosytrt.tools.bench
    p = argparse.ArgumentParser(prog="python -m cosytrt.tools.bench")
    add_arguments(p)
    return run(p.parse_args(argv))
