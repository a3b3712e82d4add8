"""CUDA graphs captured per bucket: static input/output buffers, one shared memory pool, replay for every call.

`GraphCache(fn)` captures `fn(*inputs)` once per key (a bucket key) with static buffers shaped like the example inputs;
`run(key, *inputs)` copies the inputs in, replays, and returns the static outputs — borrowed buffers that the next
replay of the same key overwrites, so callers copy (or consume on the same stream) before the next call.
Graphs are captured largest-first so smaller ones reuse the pool (nano-vllm / sglang practice).
"""
from __future__ import annotations

import gc
import weakref
from typing import Callable

import torch

_CACHES: "weakref.WeakSet[GraphCache]" = weakref.WeakSet()  # every GraphCache with a group (`capture_group_on`)


class GraphCache:
    def __init__(self, fn: Callable | None, device: torch.device | str = "cuda", warmup: int = 2,
                 stream: torch.cuda.Stream | None = None, group: str | None = None):
        self.fn = fn
        self.device = torch.device(device)
        self.warmup = warmup
        self.pool = None
        self.group = group  # e.g. "dit" / "hift": `capture_group_on` captures a group's graphs again elsewhere
        self._fns: dict = {}  # key -> the key's own function, where capture was given one
        if group is not None:
            _CACHES.add(self)
        # the capture stream (None: created with the first capture). A stream of a CUDA green context confines the
        # graphs' kernels to its SMs when they are replayed there; a graph captured on an ordinary stream is not
        # confined by replaying it on a green one (BENCHMARKS.md run 67)
        self._stream = stream
        self._asked = stream  # the capture stream asked for (None: the cache's own)
        self.graphs: dict = {}  # key -> (graph, static_inputs, static_outputs)

    def __contains__(self, key) -> bool:
        return key in self.graphs

    def capture(self, key, example_inputs: tuple, static: bool = False, collect: bool = True,
                fn: Callable | None = None) -> None:
        """Capture `fn(*example_inputs)` under `key` (`fn`: this key's own function, default the cache's). `static`:
        the example inputs ARE the static buffers (the caller fills them and calls `run(key)` with no inputs; buffers
        shared by several keys) instead of being copied. `collect`: a garbage collection before the capture (a
        caller capturing many graphs does one itself)."""
        if fn is not None:
            self._fns[key] = fn
        fn = self._fns.get(key, self.fn)
        static_in = tuple(example_inputs) if static else static_copies(example_inputs)
        # ONE capture stream for all of this cache's graphs: the caching allocator reuses a freed block only for
        # allocations on the stream that freed it, so graphs captured on a new stream each could not share the
        # pool's memory and each kept its own peak (160 cached-hop DiT graphs took ~70 GB on an 80 GB H100)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(self.warmup):  # flush lazy init / autotuning outside the capture
                fn(*static_in)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if collect:
            gc.collect()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool, stream=stream):
            static_out = fn(*static_in)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, static_in, static_out)

    def recapture(self, stream: torch.cuda.Stream | None) -> None:
        """Capture every graph again, in its first capture's order (largest first), on `stream` (None: a new stream
        of the cache's own), keeping each key's static input buffers (callers' copies into them stay valid); the
        old graphs and their pool go first. What `capture_group_on` runs."""
        keep = [(key, static_in) for key, (_, static_in, _) in self.graphs.items()]
        self.graphs, self.pool = {}, None
        self._stream = self._asked = stream
        gc.collect()
        for key, static_in in keep:
            self.capture(key, static_in, static=True, collect=False)

    def run(self, key, *inputs):
        graph, static_in, static_out = self.graphs[key]
        with torch.inference_mode():  # the static inputs are inference tensors
            for dst, src in zip(static_in, inputs):
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src, non_blocking=True)
        graph.replay()
        return static_out


def indexed_device(d) -> torch.device:
    """`d` as a torch.device with its index ("cuda" and "cuda:0" name the same device)."""
    d = torch.device(d)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def capture_group_on(group: str, device, stream: torch.cuda.Stream | None) -> int:
    """Capture the graphs of every live GraphCache of `group` on `device` again on `stream` (None: on a stream of
    each cache's own), where they were captured on another; returns how many caches were. A CUDA green context's
    stream confines the kernels of graphs captured on it when they replay there, not those of graphs captured on an
    ordinary stream (BENCHMARKS.md run 67): the scheduler's SM partition (dit_green_reserve_sms) moves the pipeline's
    DiT and vocoder graphs with this, and back when a later scheduler has none. Call it while nothing replays those
    graphs (a scheduler's start: the pipeline serves one scheduler at a time)."""
    device = indexed_device(device)
    n = 0
    for cache in list(_CACHES):
        if cache.group != group or indexed_device(cache.device) != device or cache._asked is stream:
            continue
        if cache.graphs:
            cache.recapture(stream)
            n += 1
        else:  # nothing captured yet: its first captures go there
            cache._stream = cache._asked = stream
    return n


def static_copies(inputs: tuple) -> tuple:
    """The static input buffers of a graph: clones of the example inputs made under inference mode, like every tensor
    the scheduler's workers pass. A torch.compile'd function guards on whether its inputs are inference tensors, so
    buffers made outside inference mode would leave the workers' first uncaptured call (a shape no bucket holds) to
    compile the function again: a minute for the full-size DiT on the H200, a stall of every request in flight."""
    with torch.inference_mode():
        return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (a CPU tensor) on `device` without blocking the host: on CUDA through pinned memory and a non-blocking
    copy (a copy from pageable memory synchronizes the stream first, so a worker that keeps GPU work queued ahead
    would wait for all of it); elsewhere a plain copy. The pinned block is not reused before the copy completes
    (the caching host allocator records the copy's stream)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

