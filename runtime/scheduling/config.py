"""SchedulerConfig: the knobs of admission, batching per stage and the batching policies."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...engines.errors import InputError
from ..models import decode_attention_triton
from ..models import dit_conv as dit_conv_impls
from ..models.llm import DECODE_ATTENTION_IMPLS

DECODE_ATTENTION_CHOICES = ("auto",) + DECODE_ATTENTION_IMPLS

MAX_DECODE_STEPS = 32  # ar_decode_steps: LM steps one multi-step graph holds, at most

@dataclass
class SchedulerConfig:
    # admission (scheduling/admission.py; the server configures the same control with its own flags)
    max_in_flight: int = 64           # requests admitted and not finished
    on_full: str = "wait"             # "wait" (up to submit_timeout_s) or "reject" when max_in_flight is reached
    submit_timeout_s: float = 30.0
    max_waiting: int | None = None    # callers waiting for a slot at most (None: any number); beyond: QueueFullError
    ar_max_batch: int = 32            # KV-cache slots = most requests decoding together
    ar_max_prefill_tokens: int = 4096  # padded tokens (rows x longest) of one batched prefill
    ar_max_len: int | None = None     # KV positions per slot; None: from the noise buffers (see Scheduler)
    dit_max_requests: int = 8         # requests per DiT call (CFG rows = 2x)
    dit_max_wait_ms: float = 5.0
    hift_max_batch: int = 16
    # more streams' vocoder windows ready than one call takes: least playback slack first (a first chunk, an
    # underrunning stream; `policies.pick_hift_jobs`), as dit_slack_priority does for the DiT; off: queue order.
    # Ordering only (each stream's windows stay in order; the audio is the same). Run 66 (12 req/s): HiFT 86 % busy,
    # the vocoder part of the first audio 0.30 s at p95 — not yet A/B'd (`--ab hift_slack_priority`)
    hift_slack_priority: bool = True
    # on CUDA, > 0: vocoder calls the HiFT thread may have launched and not yet seen complete (`Token2WavWorker.
    # _hift_fence`, as dit_steps_ahead for the DiT); 0: no bound (today's default). Why: at 12 req/s of mixed
    # streams (runs 66 and 68, H100) the vocoder part of the first audio was 0.30 s at p95 (0.05 at p50) while the
    # HiFT thread sat idle 76 % of the cell: it launches every window as it comes, so the vocoder's stream holds a
    # queue of launched calls (its GPU ~80 % busy) that a first chunk joins at the back, past the reach of
    # hift_slack_priority. With a bound the queue waits on the host, where a first chunk goes first and more windows
    # share a call. Ordering and grouping only (the HiFT's rows are exact per row: tests/test_scheduler.py). Not
    # yet run on a GPU (A/B: `--ab "hift_calls_ahead=0,hift_calls_ahead=2"`)
    hift_calls_ahead: int = 0
    hift_max_wait_ms: float = 5.0
    hift_max_frames: int = 8192       # rows x longest mel frames of one offline HiFT call
    max_padding_waste: float = 1.5    # padded work / real work allowed when grouping DiT and HiFT rows
    frontend_workers: int = 2
    cuda_graphs: bool = True          # on CUDA: capture the AR decode step per batch bucket and KV-length rung
    compile: bool = False             # torch.compile the AR prefill and decode step (before the CUDA-graph capture)
    # The batching policies, each switchable off to measure what it buys (`trtbuild bench --suite features`):
    continuous_batching: bool = True  # off: admit new requests only when no request is decoding (static batches)
    dit_chunk_aligned: bool = True    # off: one request per DiT call, dispatched at once (no cross-request batches)
    dit_slack_priority: bool = True   # off: each DiT call is built around the oldest queued job (see playback_slack)
    # on: the DiT worker advances rows one Euler step per call (prefix-cached hops too, each row at its own step), so
    # a new first hop joins the next step instead of waiting for a long final. On by default: on the H200 (open loop,
    # graphs_ar, runs 29-31) TTFA p95 1.5-1.6x lower at 4-8 req/s in the same run; near saturation (8 req/s) 13 %
    # less audio per second and twice the streams with an underrun then (the DiT thread's host time per step); with
    # the paged prefix store (run 36, H100, same process) TTFA p95 2.1-2.6x lower at 4-8 req/s and half the stall
    # seconds at 8 req/s. Off: the whole 10-step solve per call (for offline batch jobs near saturation)
    dit_step_level: bool = True
    # with dit_step_level: a stream's first DiT job starts at once instead of waiting up to dit_max_wait_ms for
    # company (later jobs join its next step, so the wait buys no batching; run 39: the whole 5 ms of a lone first
    # hop's queue wait at 1 req/s; run 41 with it: 1 ms at the median). Ordering only
    dit_first_now: bool = True
    hift_length_aware: bool = True    # off: offline HiFT batches in arrival order, no padding-waste limit
    async_d2h: bool = True            # off (CUDA): each chunk's device-to-host copy blocks the HiFT worker
    # on CUDA: the AR worker's stream gets the device's highest priority, so its small decode kernels are scheduled
    # ahead of the DiT / HiFT kernels queued beside them (the AR step is on the path of every first chunk)
    ar_stream_priority: bool = True
    # on CUDA: while the scheduler runs, the interpreter hands the GIL between threads every 0.5 ms instead of 5 ms
    # (sys.setswitchinterval; restored when the last such scheduler closes: `scheduler.use_fast_gil_switch`). The DiT
    # thread needs the GIL for a little Python at every Euler step beside the AR thread's per-token Python, so each
    # hand-over can cost it up to a whole interval. Off by default: no clear change on graphs_ar (run 42), not yet
    # A/B'd on the compiled variant (run 41: a thread waiting for the lock waits 0.1 ms at the median, 1.8 ms at p95
    # at saturation, 5 ms switches)
    fast_gil_switch: bool = False
    # on CUDA: the HiFT worker runs on its own highest-priority stream (waiting only for the DiT step that made each
    # mel, by event; the mel kept from the DiT's allocator by record_stream) instead of the DiT's stream, so a first
    # chunk's vocoder window does not queue behind the DiT steps already launched and the DiT's steps do not queue
    # behind the vocoder's fp32 convolutions. Ordering only (the same kernels on the same data, each mel waited for
    # by event: the same audio; the GPU token / audio check of batch_invariance_gpu.py has not yet run with it —
    # BENCHMARKS.md, next GPU session). On by default since runs 59-60 (H100, compiled, mixed streams): at 12 req/s
    # 82.2 vs 74.0 and 81.1 vs 65.5 audio s/s in two runs with the order swapped (TTFA p95 2.78 vs 3.62 s, 2.72 vs
    # 7.16 s); at 8 req/s 71.6 vs 69.6 (TTFA p95 1.13 vs 1.11 s); 40 s streams at 2 / 3 req/s 57.0 / 66.0 vs 58.0 /
    # 64.3; 1 req/s TTFA p50 / p95 0.095 / 0.116 vs 0.092 / 0.105 s (18 streams). Earlier: a gain on graphs_ar at
    # 8 req/s (run 42), none on the compiled variant at 8 req/s (run 44)
    hift_own_stream: bool = True
    # on CUDA: SMs kept free of the DiT's and the vocoder's kernels for the AR (0: off). The DiT and HiFT threads then
    # launch on streams of a CUDA green context holding the device's other SMs (`sm_partition.green_streams`); the AR
    # stays on all of them. Why: under load the AR's decode step (~300 small kernels in a graph) takes 5.8 ms at 15
    # rows against ~1.5 ms alone (run 66): each kernel waits for SMs that the DiT's and the vocoder's large kernels
    # hold, which stream priority does not take back. Run 67 (H100, benchmarks/green_ctx_probe.py): an AR-like step
    # of 16 rows took 0.38 ms alone and 6.2 ms beside a GEMM load on a plain stream; with the load in a green context
    # keeping 8 / 32 / 64 SMs for the AR, 2.2 / 0.93 / 0.60 ms, the load giving up 14 / 25 / 39 % of its TFLOP/s.
    # Only graphs CAPTURED on a green stream run confined there (one captured on a plain stream and replayed on the
    # green one: 6.5 ms, unconfined): the scheduler captures its cached-hop graphs on the partition's DiT stream
    # (`CachedHopGraphs.use_capture_stream`) and captures the pipeline's DiT buckets and vocoder graphs again on the
    # partition's DiT / HiFT streams at its start (`engines.cuda_graphs.capture_group_on`; back to streams of their
    # own for a later scheduler without a partition; stats()["setup_s"]["graphs_recaptured"]).
    # Placement only (the same kernels on the same data: the same audio). Needs a torch whose green contexts give
    # streams (`GreenContext.Stream`: torch 2.11 on the device does). The partition lives for the process (a later
    # scheduler with the same reserve reuses it: sm_partition). Off by default — under traffic it lost (run 68, H100,
    # compiled, mixed streams): 32 SMs kept for the AR gave 86.6 / 87.6 audio s/s at 12 / 16 req/s against 102.1 /
    # 99.2 without, TTFA p95 1.52 / 6.21 s against 1.12 / 3.87, and the AR's step got slower, not faster (8.5 vs 6.5
    # ms per step): the probe's mechanism is not what bounds the AR in the real process
    dit_green_reserve_sms: int = 0
    # on CUDA, with dit_step_level: DiT steps the DiT thread may have launched and not yet seen complete (it plans the
    # next step while they run; `Token2WavWorker._fence`). 1: one step ahead. More lets the thread run further ahead
    # of the GPU when its host work per step varies (run 51: the DiT thread waited for its GPU work 43-45 % of the
    # 8-12 req/s cells while the GPU had a kernel running 43-46 % of the time), at the cost of a newly ready first
    # hop queueing behind that many launched steps. Ordering only (the same audio). Not yet run on the GPU
    dit_steps_ahead: int = 1
    # with dit_step_level: jobs mid-solve at most before a queued job may start (0: no bound, the default). Past
    # saturation the slack-first step-level DiT keeps starting newly urgent jobs while older ones wait mid-solve, and
    # each started cached hop holds a solver-arena slot and its commit's prefix-pool pages (run 63: the 40 s cell's
    # pool full, a third of its hops falling back; 213-235 arena misses at 12 req/s mixed); with a bound, only a
    # stream's first job (its listener has nothing yet) starts beyond it, the rest wait for mid-solve jobs to finish.
    # Ordering only (the same audio). Not yet run on a GPU: an A/B lever for the overloaded cells
    dit_max_active: int = 0
    # the compiled cached-hop DiT step gets each layer's prefix K / V as a tensor of its own (True, the default since
    # session 24) or the one [depth, rows, frames, D] tensor (False: the form before). Under torch.compile a layer's
    # in-place write into a slice of the one input was functionalised as a copy of the WHOLE input per layer (depth^2
    # buffer copies per Euler step: the `triton_poi_fused_copy_select_slice_view_*` kernels, ~0.8 ms each at 40 s
    # prefixes in run 63's profile); per-layer inputs are written in place (tests/test_flow_hop_graphs.py reads the
    # generated code). The same values either way (the same kernels' arithmetic); kept as a switch for the A/B
    dit_kv_layer_inputs: bool = True
    # the cached hops' attention reads the prefix K / V in place from the flow prefix store's pages
    # (models/hop_attention.py: a Triton kernel through the call's row table) instead of gathering every layer's
    # prefix into a buffer first (30 % of a long-prefix step's kernels in run 64). The same attention up to the fp32
    # reduction order (tests/test_hop_attention.py); where Triton does not run (CPU) the op gathers as before.
    # None (auto): on where the kernel runs (CUDA with Triton). Run 66 (H100, open loop, compiled): 12 req/s mixed
    # 103-104 against 97 audio s/s, TTFA p95 1.00-1.10 against 1.21 s, half the underruns; 40 s streams at 3 req/s
    # 89 against 77 audio s/s. Overrides dit_kv_layer_inputs
    dit_paged_prefix: bool | None = None
    # the DiT's grouped convolutions from this scheduler's start to its close ("" = the process's, COSYTRT_DIT_CONV;
    # else one of runtime/models/dit_conv.py's choices: auto, cudnn, nhwc, unfold, triton). A process-wide A/B lever
    # (`--ab "dit_conv=nhwc,dit_conv=triton"`): the cached-hop graphs a scheduler captures take it, the whole-history
    # DiT graphs captured at the process's set-up keep theirs. The same convolution either way (tests/test_flow.py)
    dit_conv: str = ""
    # the decode step's sampling (stop masks, RAS) captured in the decode CUDA graphs after the LM step
    # (`models.sampling.StaticSampler`): a step is one replay and one read of the ids, ~35 fewer kernel launches and
    # their Python on the AR thread. Exact (the same ids: tests/test_sampling_exact.py, test_ar_graphs.py, on an H100
    # too, BENCHMARKS.md run 40); batches it does not fit (another top_k, a wider RAS window) sample as before. An AR
    # runner made without it takes it on when a scheduler with it starts (TTS.reconfigure: a second decode graph set,
    # no new runner). Off by default: without `ar_event_sync` it slowed the DiT and vocoder under load (runs 42-43:
    # compiled 8 req/s 38 vs 62 audio s/s); with it (run 48, 8 req/s) 57.6 audio s/s and TTFA p95 0.55 s against
    # 59.1 / 0.61 for the event read-back alone — no clear gain yet. On the CPU, without graphs, 9-21 % more per step
    ar_graph_sampling: bool = False
    # > 0: while every streaming request the AR decodes has had its first DiT job queued and one of them is still
    # waiting for its first audio, the AR worker holds its next decode step (at most this many ms after that first
    # job was queued), so the first hop's DiT steps and vocoder window get the GPU to themselves; a stream still
    # short of its first hop's tokens, or a request waiting for admission, ends the hold. Ordering only (the tokens
    # and audio are the same); stats()["ar"]["first_audio_holds"] / ["first_audio_hold_s"]. Off (0) by default:
    # not yet run on the GPU (the question it asks: at 1 req/s the first DiT job took 33 ms, run 43, against ~18 ms
    # of DiT steps alone, run 5 — is the difference the AR's kernels beside it?)
    ar_first_audio_hold_ms: float = 0.0
    # > 0: AR pacing (`policies.ar_step_due`): the AR worker makes a decode step only while some stream needs tokens
    # within this many seconds (the end of the audio its hops cover, counted from its playback start, less the steps
    # its next hop still needs) — or an offline request runs, a stream waits for its first hop's tokens, or a request
    # waits for a KV slot; then every running row advances. So streams stop running ~10x ahead of their listeners in
    # small batches: fewer AR steps of more rows each, less AR time beside the DiT. Ordering only (the same tokens
    # with batch_invariant; otherwise as any batching change). stats()["ar"]["pace_waits"] / ["pace_wait_s"]. Streams
    # stay in flight longer (KV slots; their flow prefix until the final). Off (0) by default: one run so far (run 48,
    # H100, compiled, 8 req/s, lead 2 s): TTFA p95 0.44 vs 0.80 s, AR busy 0.65 vs 0.94, 9.5 vs 8.2 rows per step,
    # the prefix pool's peak lower (15.4 vs 18.8 GB) — but in an 18 s cell the long streams' finals were still to
    # come (deferred, not saved, work), so it needs a longer cell and 12 req/s before it is a default
    ar_pace_lead_s: float = 0.0
    # on CUDA: the AR worker reads each step's sampled ids back by a non-blocking copy into pinned memory and an event
    # wait (`models.sampling.ids_to_host`) instead of `.tolist()`'s synchronous copy into pageable memory, which (by
    # runs 42-43 and 48; the mechanism is not shown) held the other threads back while the AR thread waited.
    # Process-wide while any scheduler with it runs (`sampling.use_event_sync`); the same ids. On by default: on an
    # H100 (run 48, compiled, 8 req/s, one process) TTFA p95 0.61 vs 0.80 s, 59.1 vs 56.2 audio s/s delivered within
    # the arrival window (all of it by the drain's end either way); and with it the sampling inside the decode graphs
    # no longer slows the other stages (57.6 audio s/s, where run 43 without it measured 38 vs 62)
    ar_event_sync: bool = True
    # > 1: the AR worker decodes this many steps per runner call where it can (`ARWorker._decode_steps`): the
    # steps' sampling on the device (`StaticSampler`, as `ar_graph_sampling`), each step's ids fed back as the next
    # step's tokens and shifted into the RAS window there (`stages.ar_graphs.decode_steps`; on CUDA one multi-step
    # graph per batch bucket and KV rung, captured at start). The host uploads the inputs, replays and reads the
    # ids back once per call and then books the steps one by one as single steps do, so the tokens are the same
    # (each row's own uniforms, drawn in the same order; a row that stops mid-call drops its later ids; tests in
    # tests/test_ar_decode_steps.py, the graphs on an H100 too, run 54) — exactly so with `batch_invariant`; without
    # it a call's steps attend the KV rung its last step needs, which may be longer than a single step's, an effect
    # of the same kind as batching (the rung follows the batch's longest row). Why: under load the AR thread's host
    # work per step, not the GPU, set the AR's pace (runs 47 and 51-53: ~0.85 ms of kernels in 4-8 ms per step; the
    # 40 s streams and offline jobs AR-bound at 61-93 audio s/s, the AR 96-99 % busy). Costs: a token reaches the
    # DiT up to K-1 steps later; a row that stops mid-call computes the rest of the call; a request waiting for
    # admission waits up to K steps; K times the decode graphs' capture. Rows the device sampler does not hold
    # (another RAS window, a top_k above 25) take K single steps beside the others' call; rows near their length
    # limit and calls that do not fit the graphs take single steps. Off (1) by default: not yet measured under load
    # on a GPU
    ar_decode_steps: int = 1
    # > 0: load shedding. A new request is refused at once (`admission.OverloadedError`; HTTP 503 "overloaded" with
    # Retry-After) while some live stream is more than this many seconds behind its listener — its playback slack
    # below -shed_lag_s: an underrun that deep, or a first audio awaited that long (`Lifecycle.worst_stream_lag`,
    # stats()["stream_lag_s"], /metrics cosytrt_stream_lag_seconds). Past saturation every admitted stream falls
    # behind (run 51: 219 of 293 streams underran at 12 req/s); shedding keeps the admitted ones playing and tells
    # the rest to retry. A request under a lease (a later segment of an admitted HTTP request) or following another
    # (`after`: a conversation's next sentence) is never shed. Refusals: stats()["shed"]. Off (0) by default: not
    # yet measured on a GPU (`benchmarks/session19_call.sh`, CALL=shed)
    shed_lag_s: float = 0.0
    # The LM decode step's attention (`CosyVoice3LM.decode_attention_impl`): "sdpa" (fused SDPA; the reduce form for
    # the smallest batches under compile), "split_kv" (models/decode_attention_triton.py: split-KV Triton kernels,
    # each row read up to its own length, parallel over fixed key splits; CUDA needs Triton) or "auto" (the default:
    # "split_kv" on CUDA where Triton imports, else "sdpa"; `decode_attention_for`). Why: at 12 req/s of mixed
    # streams the AR's fused SDPA was the heaviest kernel of the process (run 56, ~0.7 ms of a ~1.8 ms step's
    # kernels), ~10x above what reading K and V costs. Values agree within bf16 rounding (fp32 softmax); a row's bits
    # are the same alone and beside others. The first version lost on an H100 (runs 58-59); rewritten with one
    # tensor-core tile per split it takes 4.7-46 µs a layer against SDPA's 15-47 (run 62), and in the compiled
    # variant at 12 req/s of mixed streams on the H200 it delivered 60.5 vs 54.0 audio s/s, TTFA p50 2.4 vs 3.6 s
    # (run 63; 40 s streams at 3 req/s: the same, 46.6 vs 46.8)
    ar_decode_attention: str = "auto"
    # The LM and its AR runner in a process of their own (`scheduling/ar_process.py`), on the same device: the AR's
    # per-step Python then no longer shares the interpreter lock with the DiT, vocoder, frontend and server threads
    # (run 68: under open-loop load a 6.45 ms AR step for ~1.3 ms of its kernels, the device busy 42 % of the time).
    # The child gets the LM's weights exactly and runs the same AR worker, so the tokens and audio are the same
    # (tests/test_ar_process.py). Costs: the child's start (spawn, the LM copied, its own compile and graphs), a
    # second CUDA context, a pipe hop per AR step that hands tokens on. Not with a TensorRT-LLM AR engine, nor with
    # ar_first_audio_hold_ms / ar_pace_lead_s (they read the streams' playback state, which stays in this process).
    # Off by default: not yet measured on a GPU
    ar_process: bool = False
    ar_graph_batches: tuple = (1, 2, 4, 8, 16, 32, 64)
    ar_prefill_graph_batches: tuple = (1, 2, 4, 8)     # on CUDA: prefill captured per (rows, padded length)
    ar_prefill_graph_lengths: tuple = (64, 128, 256, 384, 512)
    # Flow prefix KV cache (stages/flow_cache.py, flow_hops.py): non-final DiT hops compute only their new frames; a
    # saved speaker's prompt chunks are computed once (flow_prompt_cache). Budget in bytes (None: 40 % of the GPU, at
    # most what is free at start less a reserve; 1 GiB on CPU: flow_cache.default_budget), allocated as pages when the
    # scheduler starts; a hop that does not fit runs as today (stats()["dit"]["cache_fallbacks"]).
    # None (auto): on where the backends capture cached hops in CUDA graphs (`StageBackends.dit_cached`, from a
    # profile's dit.cached grid), off elsewhere: on the H200 graphed cached hops served 1.26x the audio of
    # whole-history hops with 5x fewer stall seconds, while eager cached hops (launch-bound) were 1.6x slower
    # (measured: BENCHMARKS.md).
    flow_prefix_cache: bool | None = None
    flow_prompt_cache: bool = True
    flow_cache_budget_bytes: int | None = None
    # A request's tokens do not depend on the other requests batched with it, nor on the padded bucket / KV rung
    # (same seed, same tokens). The LM then runs batch-invariant kernels (runtime/models/batch_invariant.py). Off by
    # default: on the H200 it doubled the time to first audio under open-loop load (measured: BENCHMARKS.md).
    batch_invariant: bool = False

    def __post_init__(self):
        if self.on_full not in ("wait", "reject"):
            raise InputError(f"SchedulerConfig.on_full must be 'wait' or 'reject', got {self.on_full!r}")
        for name in ("max_in_flight", "ar_max_batch", "ar_max_prefill_tokens", "dit_max_requests", "hift_max_batch",
                     "hift_max_frames", "frontend_workers", "ar_decode_steps", "dit_steps_ahead"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InputError(f"SchedulerConfig.{name} must be a positive int, got {v!r}")
        if self.ar_decode_steps > MAX_DECODE_STEPS:  # each multi-step graph holds that many LM steps
            raise InputError(f"SchedulerConfig.ar_decode_steps must be at most {MAX_DECODE_STEPS}, got "
                             f"{self.ar_decode_steps!r}")
        if not isinstance(self.shed_lag_s, (int, float)) or isinstance(self.shed_lag_s, bool) \
                or not math.isfinite(self.shed_lag_s):
            raise InputError(f"SchedulerConfig.shed_lag_s must be a finite number of seconds (0: off), got "
                             f"{self.shed_lag_s!r}")
        w = self.max_waiting
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 0):
            raise InputError(f"SchedulerConfig.max_waiting must be None or an int >= 0, got {w!r}")
        if self.ar_max_len is not None and (not isinstance(self.ar_max_len, int) or self.ar_max_len < 1):
            raise InputError(f"SchedulerConfig.ar_max_len must be a positive int or None, got {self.ar_max_len!r}")
        if self.dit_conv not in ("",) + dit_conv_impls.CHOICES:
            raise InputError(f"SchedulerConfig.dit_conv must be '' (the process's) or one of "
                             f"{', '.join(dit_conv_impls.CHOICES)}, got {self.dit_conv!r}")
        for name in ("dit_green_reserve_sms", "hift_calls_ahead"):
            r = getattr(self, name)
            if not isinstance(r, int) or isinstance(r, bool) or r < 0:
                raise InputError(f"SchedulerConfig.{name} must be an int >= 0 (0: off), got {r!r}")
        if not isinstance(self.dit_max_active, int) or isinstance(self.dit_max_active, bool) or self.dit_max_active < 0:
            raise InputError(f"SchedulerConfig.dit_max_active must be an int >= 0 (0: no bound), got "
                             f"{self.dit_max_active!r}")
        if self.ar_process and (self.ar_first_audio_hold_ms > 0 or self.ar_pace_lead_s > 0):
            raise InputError("SchedulerConfig.ar_process cannot be combined with ar_first_audio_hold_ms or "
                             "ar_pace_lead_s: they read the streams' playback state, which the AR process does not "
                             "see")
        for name in ("submit_timeout_s", "dit_max_wait_ms", "hift_max_wait_ms", "ar_first_audio_hold_ms",
                     "ar_pace_lead_s", "shed_lag_s"):
            if getattr(self, name) < 0:
                raise InputError(f"SchedulerConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("dit_paged_prefix", "flow_prefix_cache"):  # auto-or-bool fields
            if not any(getattr(self, name) is v for v in (None, True, False)):
                raise InputError(f"SchedulerConfig.{name} must be None (auto), True or False, got "
                                 f"{getattr(self, name)!r}")
        b = self.flow_cache_budget_bytes
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise InputError(f"SchedulerConfig.flow_cache_budget_bytes must be None or an int >= 0, got {b!r}")
        if self.max_padding_waste < 1:
            raise InputError(f"SchedulerConfig.max_padding_waste must be >= 1, got {self.max_padding_waste!r}")
        if self.ar_decode_attention not in DECODE_ATTENTION_CHOICES:
            raise InputError(f"SchedulerConfig.ar_decode_attention must be one of "
                             f"{', '.join(DECODE_ATTENTION_CHOICES)}, got {self.ar_decode_attention!r}")

    def decode_attention_for(self, device) -> str:
        """The decode attention the LM runs on `device` (one of DECODE_ATTENTION_IMPLS): "auto" is "split_kv" on
        CUDA where Triton imports, else "sdpa"; an explicit choice stays as it is (the scheduler refuses "split_kv"
        on CUDA without Triton)."""
        if self.ar_decode_attention != "auto":
            return self.ar_decode_attention
        if torch.device(device).type != "cuda":
            return "sdpa"
        return "split_kv" if decode_attention_triton.available() else "sdpa"


def config_overrides(items, what: str = "scheduler setting", reserved: dict | None = None) -> dict:
    """SchedulerConfig overrides from `NAME=VALUE` strings (or a dict): each name a boolean, int, float or string field
    (e.g. on_full=reject), each value of its type (booleans as 0 / 1 / true / false; `auto` / `none`: None where the
    field takes it, e.g. dit_paged_prefix=auto); the whole config is then checked
    by SchedulerConfig itself.
    `reserved`: names refused with the reason given (e.g. the server's admission limits, which have flags of their
    own). InputError naming `what` and the item. What `trtbuild serve --scheduler` and `trtbuild bench --ab` take."""
    import dataclasses

    reserved = reserved or {}
    pairs = list(items.items()) if isinstance(items, dict) else [str(i).partition("=")[::2] for i in items or ()]
    kinds = {f.name: str(f.type).replace(" ", "") for f in dataclasses.fields(SchedulerConfig)}
    out: dict = {}
    for name, value in pairs:
        name = str(name).strip()
        if name in reserved:
            raise InputError(f"{what}: {name} {reserved[name]}")
        kind = next((k for k in ("bool", "int", "float", "str") if k in kinds.get(name, "").split("|")), None)
        if kind is None:
            raise InputError(f"{what}: {name!r} is not a boolean, numeric or string SchedulerConfig field")
        text = str(value).strip().lower()
        try:
            if text in ("auto", "none") and "None" in kinds[name].split("|"):  # an auto-or-value field's default
                out[name] = None
            elif kind == "str":
                out[name] = str(value).strip()
            elif kind == "bool":
                if text not in ("0", "1", "true", "false"):
                    raise ValueError
                out[name] = text in ("1", "true")
            else:
                out[name] = int(text) if kind == "int" else float(text)
        except ValueError:
            raise InputError(f"{what}: {name}={value!r} is not a valid {kind}") from None
    SchedulerConfig(**out)  # its own checks (ranges, combinations)
    return out
