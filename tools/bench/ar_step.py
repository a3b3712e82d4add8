"""Host time of one AR worker decode step (issue #18: the AR thread's per-step overhead).

    PYTHONPATH=.shim python -m cosytrt.tools.bench.ar_step [--batches 1,8,32] [--steps 100] [--device cpu|cuda]

Drives `ARWorker._decode` (decode inputs -> runner.decode -> `sample_batch` -> bookkeeping -> sink) for B running
requests, default sampling parameters, one seed per row, with two runners:
- `fixed`: a runner that returns the same logits every step (speech-vocab width, stop ids at -inf so no row ends):
  the worker's own time per step, the LM left out;
- `tiny`: `TorchARRunner` over the tiny CosyVoice3 LM (seeded random weights, fp32; on CUDA in its decode graphs):
  the whole step; `tiny sampled`: the same with `ar_graph_sampling` (on CUDA the sampling inside the decode graphs;
  on the CPU the same fixed-shape sampler, eagerly); `tiny x4`: `ar_decode_steps=4` (four steps per runner call,
  sampled on the device; on CUDA in multi-step decode graphs), its µs divided by 4: per token step.
`--gil-load N`: N threads beside it that each run Python for `--gil-hold-us` and then sleep `--gil-gap-us` (the
interpreter lock held and released as the DiT and vocoder threads of a loaded server do): every host operation of
the AR step that gives up the lock may wait for it (runs 47 and 51-53: under load the AR's step took 4-8 ms around
~1 ms of kernels); `4 steps per call` pays that once per four tokens.
`--gpu-load F` (CUDA): a thread keeping the GPU busy about F of the time with DiT-sized GEMMs on a stream of its own
during the timed steps — the AR's cost of sharing the GPU, apart from that of sharing the lock.
Prints microseconds per step (median of `repeats` blocks of `steps` steps), for `fixed` the aten ops per step that
are not views (about the kernel launches of a GPU step), and for `tiny` the part spent outside `runner.decode` (on
CUDA that includes waiting for the GPU: the decode is only launched). On CUDA every step ends in the sampling's host
sync, so a `fixed` step is host time plus the sampling kernels. A measuring tool: no test checks its numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from types import SimpleNamespace

import torch

V_STOP = 6561


class FixedRunner:
    """An `ARRunner` whose decode returns fixed logits [B, V]: measures the worker around the LM."""

    def __init__(self, max_batch: int, vocab: int = 6761, seed: int = 0, device: str = "cpu"):
        self.max_batch, self.max_len = max_batch, 1 << 30
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(max_batch, vocab, generator=g) * 3.0
        self.logits[:, V_STOP:] = float("-inf")
        self.logits = self.logits.to(device)
        self._free = list(range(max_batch - 1, -1, -1))

    def allocate(self):
        return self._free.pop() if self._free else None

    def release(self, slot):
        self._free.append(slot)

    def decode(self, tokens, slots, positions):
        return self.logits[:len(tokens)]

    def close(self):
        pass


class _NullSink:
    def tokens(self, r, done):
        pass

    def flush(self):
        pass


class _Row:
    """The fields of `RequestState` that the AR worker's decode step touches."""

    def __init__(self, policy, slot: int, pos: int):
        self.policy, self.slot, self.pos = policy, slot, pos
        self.tokens: list[int] = []
        self.metrics = SimpleNamespace(t_ar=0.0)
        self.dead = False


class _TimedRunner:
    """Wraps a runner; adds up the seconds spent in `decode`."""

    def __init__(self, runner):
        self.runner, self.seconds = runner, 0.0
        self.max_batch, self.max_len = runner.max_batch, runner.max_len

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def decode(self, tokens, slots, positions):
        t0 = time.perf_counter()
        out = self.runner.decode(tokens, slots, positions)
        self.seconds += time.perf_counter() - t0
        return out

    def decode_sampled(self, tokens, slots, positions, packed):
        t0 = time.perf_counter()
        out = self.runner.decode_sampled(tokens, slots, positions, packed)
        self.seconds += time.perf_counter() - t0
        return out

    def decode_steps(self, tokens, slots, positions, packed):
        t0 = time.perf_counter()
        out = self.runner.decode_steps(tokens, slots, positions, packed)
        self.seconds += time.perf_counter() - t0
        return out


def lm_runner(max_batch: int, max_len: int = 1024, device: str = "cpu", graph_sampling: bool = False,
              model: str = "tiny", compile: bool = False, decode_attention: str = "sdpa"):
    """TorchARRunner over the tiny LM (fp32; `model="tiny"`); on CUDA with its decode graphs. `model="full"`: the
    full-size LM (seeded random weights, bf16, built once per process), its decode graphs for this batch only and
    one prefill graph (the set-up of the scheduler's whole ladders is not what is measured here).
    `decode_attention`: the LM's `decode_attention_impl` (sdpa, or split_kv)."""
    from ...runtime.stages.ar_runner import TorchARRunner

    if model == "full":
        llm = _full_lm(device)
        llm.decode_attention_impl = decode_attention
        return TorchARRunner(llm, max_batch, max_len, device, cuda_graphs=device.startswith("cuda"),
                             graph_sampling=graph_sampling, graph_batches=(), prefill_graph_batches=(1,),
                             prefill_graph_lengths=(64,), compile=compile)
    from ...runtime.models.config import tiny_config
    from ...runtime.models.loading import build_modules

    torch.manual_seed(0)
    llm = build_modules(tiny_config(), device=device)[0].eval()
    llm.decode_attention_impl = decode_attention
    return TorchARRunner(llm, max_batch, max_len, device, cuda_graphs=device.startswith("cuda"),
                         graph_sampling=graph_sampling, compile=compile)


_FULL_LM: dict = {}


def _full_lm(device: str):
    if device not in _FULL_LM:
        from .common import full_models

        _FULL_LM[device] = full_models(device, torch.bfloat16)[1]
    return _FULL_LM[device]


def _reraise(r, e: BaseException) -> None:
    raise e


def worker_for(runner, batch: int, start_pos: int = 64, device: str = "cpu", decode_steps: int = 1):
    """An ARWorker over `runner` with `batch` running rows (seeds 0..batch-1, default top_p / top_k / RAS window;
    every stop id masked, so no row ends); `decode_steps`: its `ar_decode_steps`."""
    from ...runtime.models.sampling import SamplingParams, TokenPolicy
    from ...runtime.scheduling.ar_worker import ARWorker
    from ...runtime.scheduling.config import SchedulerConfig
    from ...runtime.scheduling.stage_clock import StageClock

    # ar_graph_sampling on: a runner made with `graph_sampling` samples in the runner, the others as before
    w = ARWorker(runner, SchedulerConfig(ar_graph_sampling=True, ar_decode_steps=decode_steps), _NullSink(), _reraise,
                 StageClock(False), device)
    for i in range(batch):
        pol = TokenPolicy(1, SamplingParams(seed=i, min_tokens=1 << 20, max_tokens=1 << 20),
                          mask_all_stops_before_min=True)   # no row ends
        pol.next_input = i
        w.running.append(_Row(pol, runner.allocate(), start_pos))
    return w


def time_steps(worker, steps: int, repeats: int, timed: _TimedRunner | None = None,
               load: "GpuLoad | None" = None) -> tuple[float, float]:
    """(median µs per step, median µs per step outside runner.decode) over `repeats` blocks of `steps` steps (beside
    `load`'s GPU work when given)."""
    per, outside = [], []
    with torch.inference_mode(), (load.on() if load is not None else contextlib.nullcontext()):
        for _ in range(5):
            worker._decode()
        for _ in range(repeats):
            if timed is not None:
                timed.seconds = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                worker._decode()
            dt = time.perf_counter() - t0
            per.append(dt / steps * 1e6)
            outside.append((dt - (timed.seconds if timed is not None else 0.0)) / steps * 1e6)
    return statistics.median(per), statistics.median(outside)




def ops_per_step(worker, steps: int = 20) -> float:
    """Dispatched aten ops per decode step that are not views (on a GPU each is about one kernel launch; here the
    CPU form of the sampler, which differs from the CUDA form in the repeat resample only)."""
    from .op_count import OpCounter

    with torch.inference_mode():
        worker._decode()
        with OpCounter(views=False) as c:
            for _ in range(steps):
                worker._decode()
    return c.total / steps


MULTI_STEPS = 4
NO_OPS = float("nan")  # compiled runners: dynamo does not compile under the op counter's dispatch mode


class GilLoad:
    """`with GilLoad(n, hold_us, gap_us):` n daemon threads, each alternating `hold_us` of pure-Python work (the
    interpreter lock held) with a `gap_us` sleep (released); stopped and joined on exit. n = 0: nothing."""

    def __init__(self, n: int, hold_us: float = 500.0, gap_us: float = 500.0):
        import threading

        self.n, self.hold, self.gap = n, hold_us / 1e6, gap_us / 1e6
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, name=f"cosytrt-bench-gil-load-{i}", daemon=True)
                        for i in range(n)]

    def _run(self) -> None:
        while not self.stop.is_set():
            end = time.perf_counter() + self.hold
            x = 0
            while time.perf_counter() < end:
                x += 1
            time.sleep(self.gap)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


class GpuLoad:
    """`with GpuLoad(fraction, device) as load:` a daemon thread on a CUDA stream of its own that, while `load.on()`
    is in effect, keeps the GPU busy about `fraction` of the time with bf16 GEMMs of the DiT's feed-forward size
    (4096 x 1024 @ 1024 x 4096), as the DiT and the vocoder keep it busy beside the AR in a loaded server: every
    10 ms it launches as many GEMMs as fill that share of the period, waits for them (the interpreter lock released)
    and sleeps the rest. Separates the AR step's cost of sharing the GPU from that of sharing the lock (`GilLoad`).
    Only on during timed steps: a CUDA-graph capture (the runners' set-up) must not see another thread's waits.
    fraction 0: nothing."""

    PERIOD_S = 0.010
    SHAPE = (4096, 1024, 4096)   # (m, k, n): rows x frames of a DiT call, hidden size, feed-forward width

    def __init__(self, fraction: float, device: str = "cpu"):
        import threading

        if not 0 <= fraction < 1:
            raise ValueError(f"--gpu-load must be in [0, 1), got {fraction!r}")
        if fraction and not str(device).startswith("cuda"):
            raise ValueError("--gpu-load needs --device cuda")
        self.fraction, self.device = fraction, device
        self.stop, self.active, self.parked = threading.Event(), threading.Event(), threading.Event()
        self.parked.set()
        self.thread = None
        self.launches = 0

    def __enter__(self):
        if not self.fraction:
            return self
        import threading

        m, k, n = self.SHAPE  # buffers, stream and the GEMM's time, made here (before any capture), not in the thread
        self.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.stream):
            self.a = torch.randn(m, k, device=self.device, dtype=torch.bfloat16)
            self.b = torch.randn(k, n, device=self.device, dtype=torch.bfloat16)
            self.c = torch.empty(m, n, device=self.device, dtype=torch.bfloat16)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(3):
                torch.mm(self.a, self.b, out=self.c)
            start.record()
            for _ in range(20):
                torch.mm(self.a, self.b, out=self.c)
            end.record()
            end.synchronize()
            self.done = torch.cuda.Event()
        self.count = max(1, round(self.fraction * self.PERIOD_S / (start.elapsed_time(end) / 1e3 / 20)))
        self.thread = threading.Thread(target=self._run, name="cosytrt-bench-gpu-load", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        with torch.cuda.stream(self.stream), torch.inference_mode():
            while not self.stop.is_set():
                if not self.active.is_set():
                    self.parked.set()
                    self.active.wait(0.05)
                    continue
                self.parked.clear()
                t0 = time.perf_counter()
                for _ in range(self.count):
                    torch.mm(self.a, self.b, out=self.c)
                self.launches += self.count
                self.done.record()
                self.done.synchronize()
                time.sleep(max(0.0, self.PERIOD_S - (time.perf_counter() - t0)))
        self.parked.set()

    @contextlib.contextmanager
    def on(self):
        """The load runs inside this block (a no-op without a load); on exit its last period has completed."""
        if self.thread is None:
            yield
            return
        self.active.set()
        try:
            yield
        finally:
            self.active.clear()
            time.sleep(self.PERIOD_S)  # the thread sees the clear at the end of its period at the latest
            self.parked.wait()

    def __exit__(self, *exc):
        self.stop.set()
        self.active.set()
        if self.thread is not None:
            self.thread.join()


def table(batches=(1, 8, 32), steps: int = 100, repeats: int = 5, device: str = "cpu", gil_threads: int = 0,
          gil_hold_us: float = 500.0, gil_gap_us: float = 500.0, model: str = "tiny",
          compile: bool = False, decode_attention: str = "sdpa", gpu_load: float = 0.0) -> list[dict]:
    """One row per batch (see the module docstring); with `gil_threads` > 0 every timing runs under `GilLoad`;
    `model`: the LM of the `tiny` columns (tiny, or full: the full-size LM, bf16); `compile`: its decode step
    torch.compile'd as the compiled / graphs_ar variants do (each runner compiles as it is built: under the load when
    there is one, a longer set-up; timed after its warm-up steps); `decode_attention`: the LM's decode attention;
    `gpu_load` > 0: every timed block runs beside `GpuLoad` (the GPU busy that share of the time with other work)."""
    if model == "full":
        _full_lm(device)  # built before the load starts
    with GilLoad(gil_threads, gil_hold_us, gil_gap_us), GpuLoad(gpu_load, device) as load:
        return _table(batches, steps, repeats, device, model, compile, decode_attention, load)


def _table(batches, steps: int, repeats: int, device: str, model: str = "tiny", compile: bool = False,
           decode_attention: str = "sdpa", load: "GpuLoad | None" = None) -> list[dict]:
    rows = []
    for b in batches:
        fixed = worker_for(FixedRunner(b, device=device), b, device=device)
        fixed_us, _ = time_steps(fixed, steps, repeats, load=load)
        ops = ops_per_step(fixed)
        row = {"batch": b, "fixed_us": fixed_us, "fixed_ops": ops}
        for name, sampled in (("tiny", False), ("tiny_sampled", True)):
            timed = _TimedRunner(lm_runner(b, device=device, graph_sampling=sampled, model=model,
                                             compile=compile, decode_attention=decode_attention))
            w = worker_for(timed, b, device=device)
            row[f"{name}_us"], row[f"{name}_outside_decode_us"] = time_steps(w, max(10, steps // 2), repeats, timed,
                                                                            load)
            row[f"{name}_ops"] = NO_OPS if compile else ops_per_step(w)
        k = MULTI_STEPS  # four steps per call: each timed call is k token steps (within the runner's 1024 positions)
        runner = lm_runner(b, device=device, graph_sampling=True, model=model, compile=compile,
                           decode_attention=decode_attention)
        runner.enable_decode_steps(k)
        timed = _TimedRunner(runner)
        w = worker_for(timed, b, device=device, decode_steps=k)
        us, outside = time_steps(w, max(3, steps // (2 * k)), repeats, timed, load)
        row["tiny_x4_us"], row["tiny_x4_outside_decode_us"] = us / k, outside / k
        row["tiny_x4_ops"] = NO_OPS if compile else ops_per_step(w, 5) / k
        row["tiny_x4_calls"] = w.counters.multi_step_calls
        rows.append(row)
    return rows


def main(argv=None) -> None:
    from ...runtime.models.llm import DECODE_ATTENTION_IMPLS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the same loop on the GPU (each step ends in the "
                   "sampling's host sync, so µs = host time + what the GPU adds; tiny LM in decode graphs)")
    p.add_argument("--model", default="tiny", choices=["tiny", "full"], help="the LM of the LM columns: tiny "
                   "(fp32), or full: the full-size architecture, seeded random weights, bf16")
    p.add_argument("--compile", action="store_true", help="the LM's decode step torch.compile'd (as the compiled "
                   "and graphs_ar variants)")
    p.add_argument("--decode-attention", default="sdpa", choices=DECODE_ATTENTION_IMPLS, help="the LM's decode "
                   "attention (CosyVoice3LM.decode_attention_impl; split_kv: the split-KV Triton kernels)")
    p.add_argument("--gpu-load", type=float, default=0.0, help="share of the time (0-1) a thread keeps the GPU busy "
                   "with DiT-sized bf16 GEMMs on its own stream beside the AR (GpuLoad; CUDA only)")
    p.add_argument("--gil-load", type=int, default=0, help="threads contending for the interpreter lock beside it")
    p.add_argument("--gil-hold-us", type=float, default=500.0)
    p.add_argument("--gil-gap-us", type=float, default=500.0)
    a = p.parse_args(argv)
    try:
        GpuLoad(a.gpu_load, a.device)  # its argument checks, as a usage error
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(a.threads)
    rows = table(tuple(int(x) for x in a.batches.split(",")), a.steps, a.repeats, a.device, a.gil_load,
                 a.gil_hold_us, a.gil_gap_us, a.model, a.compile, a.decode_attention, a.gpu_load)
    load = (f"; {a.gil_load} thread(s) holding the interpreter lock {a.gil_hold_us:g} µs every "
            f"{a.gil_hold_us + a.gil_gap_us:g} µs" if a.gil_load else "")
    load += f"; the GPU {100 * a.gpu_load:.0f} % busy with DiT-sized GEMMs beside it" if a.gpu_load else ""
    print(f"AR worker decode step, {a.device}, torch {torch.__version__}, {a.threads} thread(s){load}; LM columns: "
          f"{a.model} LM{' (compiled)' if a.compile else ''}, {a.decode_attention} decode attention; "
          "µs per step (median)")
    print("| batch | fixed logits: worker host µs | its aten ops (not views) | LM: whole step µs "
          "| LM: outside runner.decode µs | its aten ops | LM, sampling in the runner: whole step µs "
          "| outside runner.decode µs | its aten ops | LM, 4 steps per call: µs per step | outside µs | ops |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['fixed_us']:.0f} | {r['fixed_ops']:.0f} | {r['tiny_us']:.0f} "
              f"| {r['tiny_outside_decode_us']:.0f} | {r['tiny_ops']:.0f} | {r['tiny_sampled_us']:.0f} "
              f"| {r['tiny_sampled_outside_decode_us']:.0f} | {r['tiny_sampled_ops']:.0f} | {r['tiny_x4_us']:.0f} "
              f"| {r['tiny_x4_outside_decode_us']:.0f} | {r['tiny_x4_ops']:.0f} |")


if __name__ == "__main__":
    main()
