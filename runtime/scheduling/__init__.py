"""Request scheduling: what runs when, across requests.

    scheduler.py         Scheduler: wires the workers with named queues; submit / stats / close
    lifecycle.py         Lifecycle (backpressure, finish / cancel once, drain) and FrontendPool
    prepare.py           frontend-side steps: LM input, flow prompt, token policy
    ar_worker.py         ARWorker: admission -> prefill / decode via an ARRunner -> sampling -> tokens to a sink
    token2wav_worker.py  Token2WavWorker: tokens -> DiT jobs -> DiT -> HiFT -> PCM (with CUDA D2H) -> handle
    policies.py          the batching decisions (admission, DiT grouping and order, HiFT grouping)
    state.py             RequestState, DitJob / HiftJob, run_rows (batch, then row by row on failure)
    handle.py            RequestHandle: the caller's side (chunks, result, cancel)
    config.py, stats.py  SchedulerConfig; typed stats (`to_dict()` is `Scheduler.stats()`)
    request.py, metrics.py, stage_clock.py   Request / RequestMetrics, aggregates, busy time per stage
"""
