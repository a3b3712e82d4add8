"""`trtbuild bench`: benchmarks on the full-size CosyVoice3 architecture (seeded random weights, forced lengths).

    python -m cosytrt.tools.bench --suite micro,serving,open_loop --out OUT      # = trtbuild bench ...
    python -m cosytrt.tools.bench.report OUT/results.json --out OUT             # tables + PNGs

Modules, each importing only the ones listed before it:
- workload.py   open-loop arrivals: Poisson at a rate, log-normal length mix, stream fraction (seeded, no model)
- playback.py   underruns / stalls of a chunk timeline and an open-loop cell's summary (pure functions)
- common.py     log, results file and time budget (`Bench`), random full-size models, the serving variants' pipeline
                and scheduler settings
- timing.py     CUDA-event timing, CUDA-graph replay timing, max abs error, per-kernel profile
- aoti.py       the AOTInductor DiT, built and timed in a child process
- micro.py      AR / DiT / HiFT micro-benchmarks with rooflines, CUDA-graph parity, c1 end to end
- dit_shapes.py DiT call ms per length x convolution implementation, CUDA graphs + kernel profile (standalone)
- ar_step.py    host µs per AR worker decode step on the CPU (`python -m cosytrt.tools.bench.ar_step`; standalone)
- serving.py    the serving matrix and the scheduler-feature comparison (waves of requests)
- open_loop.py  open-loop cells: a rate sweep until saturation, A/B over SchedulerConfig fields
- cli.py        arguments and the suite runner (`trtbuild bench`, `__main__`)
- report.py     results.json -> markdown tables and PNG plots (reads JSON only)
"""
