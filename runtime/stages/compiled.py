"""torch.compile for the hot stage functions: the AR prefill and decode step, the DiT estimator and the HiFT vocoder.

Eager PyTorch runs these as hundreds of small kernels per call (24 LM layers x ~45 kernels for one decode step; 22
DiT blocks x ~30 per estimator call), so at serving batch sizes they are launch-bound even inside a CUDA graph.
Inductor fuses the elementwise work (RMSNorm, RoPE, KV write, SiLU-gating, AdaLN modulation, gating residuals) into
a few Triton kernels around the GEMMs and attention (H200: decode step 3.2 -> 1.75 ms, DiT step 2x faster than the
eager module's graph; BENCHMARKS.md).

Shapes are dynamic (`dynamic=True`), so a new batch size or length reuses the compiled code. Dynamo still
specializes batch 1 and a slice spanning a whole buffer; the scheduler avoids both (batch-1 LM calls get a padding
row, the KV cache has a spare position), so the LM compiles once for prefill and twice for decode (<= 2 rows and more:
the decode attention takes another form for small batches, `llm.decode_attention`). The DiT compiles
once per attention mode (its convolutions are opaque to the compiler: `dit._conv1d`). On CUDA the
compiled function is then captured once per bucket in a CUDA graph, exactly like the eager one (`GraphCache`), so a
replay costs one launch.

`save_compile_cache` / `load_compile_cache` move Inductor's compiled artifacts between processes or machines of the
same GPU and torch version (torch.compiler's portable cache), so a server restart (or a benchmark on a fresh GPU
machine) skips most of the compile time.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from ..models.dit import DiT, FixedModeDiT
from ...engines.errors import InputError
from .backends import StageBackends


_MEMO = "_cosytrt_compiled"  # attribute of the owning object: its compiled functions live and die with it


def _memo(owner) -> dict:
    memo = vars(owner).get(_MEMO)
    if memo is None:
        memo = vars(owner)[_MEMO] = {}
    return memo


def compile_fn(fn: Callable) -> Callable:
    """`fn` compiled by Inductor with dynamic shapes and no graph breaks (no CUDA graphs of its own: callers capture
    per bucket). A bound method of a live object (`lm.decode`) is compiled once per process: later calls return the
    same compiled function, so a second scheduler over the same model does not compile again."""
    import torch._dynamo

    # one dynamo cache entry per specialization (DiT modes, batch guards): stay far from the default limit of 8
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", None)
    if owner is None or name is None:
        return torch.compile(fn, dynamic=True, fullgraph=True)
    per_owner = _memo(owner)
    if name not in per_owner:
        per_owner[name] = torch.compile(fn, dynamic=True, fullgraph=True)
    return per_owner[name]


COMPILE_SCOPES = ("whole", "regional")
AR_ONLY = "ar"  # TTS.load(compile=AR_ONLY): the LM only, the DiT / HiFT eager (the benchmarks' graphs_ar variant)
COMPILE_CHOICES = COMPILE_SCOPES + (AR_ONLY,)  # what TTS.load(compile=...) and `serve --compile-scope` take
_scope = {"scope": None}  # set_compile_scope (process-wide)


def set_compile_scope(scope: str | None) -> None:
    """How the DiT and the LM are compiled from now on (None: $COSYTRT_COMPILE_SCOPE, else "whole"): "whole" = each
    entry point (a DiT forward per attention mode, forward_cached, the LM's prefill and decode step) as one graph;
    "regional" = the DiT's transformer block compiled once and reused by all 22 blocks, the LM's decoder layer once
    for all 24, the thin code around them eager (CUDA graphs capture both alike). Regional
    compilation traces and lowers one block instead of 22 (one layer instead of 24): on a 2-core CPU the full-size
    DiT's first compile took 29-41 s instead of 110-144 s and the LM's prefill + decode 21 s instead of 178 s
    (benchmarks/compile_scope_cpu.py, BENCHMARKS.md); the GPU compile time and speed are not measured yet."""
    _scope["scope"] = None if scope is None else _checked(scope, "compile scope")


def compile_scope(scope: str | None = None) -> str:
    """`scope` if given, else the process's (set_compile_scope, else $COSYTRT_COMPILE_SCOPE, else "whole"), checked."""
    if scope is not None:
        return _checked(scope, "compile scope")
    if _scope["scope"] is not None:
        return _scope["scope"]
    return _checked(os.environ.get("COSYTRT_COMPILE_SCOPE") or "whole", "COSYTRT_COMPILE_SCOPE")


def _checked(scope: str, what: str) -> str:
    if scope not in COMPILE_SCOPES:
        raise InputError(f"{what} must be one of {', '.join(COMPILE_SCOPES)}, got {scope!r}")
    return scope


def compiled_lm(lm, scope: str | None = None) -> tuple[Callable, Callable]:
    """(decode, prefill) of the LM compiled in `scope` (None: `compile_scope()`): each as one graph ("whole"), or the
    eager entry points running the decoder layer compiled once for all 24 ("regional")."""
    if compile_scope(scope) == "regional":
        memo = _memo(lm)
        if "regional_layers" not in memo:
            memo["regional_layers"] = [compile_fn(layer.forward) for layer in lm.backbone.layers]
        layers = memo["regional_layers"]
        return functools.partial(lm.decode, layers=layers), functools.partial(lm.prefill, layers=layers)
    return compile_fn(lm.decode), compile_fn(lm.prefill)


class CompiledBlock:
    """One DiT block's `forward` and `forward_cached` compiled (regional compilation: every block of the model shares
    the compiled code of its class, so 22 blocks compile once)."""

    def __init__(self, block):
        self._forward = compile_fn(block.forward)
        self.forward_cached = compile_fn(block.forward_cached)

    def __call__(self, *args):
        return self._forward(*args)


class CompiledDiT:
    """A drop-in `estimator(x, mask, mu, t, spks, cond, streaming=...)`: the DiT compiled once per attention mode,
    or (scope "regional") its blocks compiled once for all (`CompiledDiT.of(dit)` returns the one instance per DiT
    and scope). `forward_cached`: the prefix-cached forward the cached hops run in the same scope."""

    def __init__(self, dit: DiT, scope: str = "whole"):
        self.dit, self.scope = dit, scope
        if scope == "regional":
            blocks = [CompiledBlock(b) for b in dit.transformer_blocks]

            def mode(streaming: bool) -> Callable:
                def run(x, mask, mu, t, spks, cond):
                    return dit.forward(x, mask, mu, t, spks, cond, streaming=streaming, blocks=blocks)
                return run

            def forward_cached(*args):
                return dit.forward_cached(*args, blocks=blocks)

            self.modes = {streaming: mode(streaming) for streaming in (False, True)}
            self.forward_cached = forward_cached
        else:
            self.modes = {streaming: compile_fn(FixedModeDiT(dit, streaming).forward) for streaming in (False, True)}
            self.forward_cached = compile_fn(dit.forward_cached)

    @classmethod
    def of(cls, dit: DiT, scope: str | None = None) -> "CompiledDiT":
        scope = compile_scope(scope)
        per_owner = _memo(dit)
        key = "CompiledDiT" if scope == "whole" else f"CompiledDiT/{scope}"
        if key not in per_owner:
            per_owner[key] = cls(dit, scope)
        return per_owner[key]

    def fixed(self, streaming: bool) -> Callable:
        """The compiled 6-input function of one mode (what CUDA graphs capture)."""
        return self.modes[streaming]

    def __call__(self, x, mask, mu, t, spks, cond, streaming: bool = False):
        return self.modes[bool(streaming)](x, mask, mu, t, spks, cond)


COMPILED_HIFT_MIN_ROWS = 2


class CompiledHiFT:
    """The vocoder compiled by Inductor (f0 predictor, sine source, conv stack with its Snake activations fused, STFT /
    iSTFT; one dynamic-shape graph per entry point): `offline(mel)` is `hift.inference(mel, finalize=True)[0]`,
    `stream_window(mel, source)` is a non-final `hift.decode` window. Dynamo specializes batch 1, so calls of fewer than COMPILED_HIFT_MIN_ROWS rows run the eager vocoder instead of
    compiling a second time (`CompiledHiFT.of(hift)` returns the one instance per vocoder)."""

    def __init__(self, hift):
        self.hift = hift
        self._offline = compile_fn(self._offline_eager)
        self._window = compile_fn(self._window_eager)

    @classmethod
    def of(cls, hift) -> "CompiledHiFT":
        per_owner = _memo(hift)
        if "CompiledHiFT" not in per_owner:
            per_owner["CompiledHiFT"] = cls(hift)
        return per_owner["CompiledHiFT"]

    def _offline_eager(self, mel: torch.Tensor) -> torch.Tensor:
        return self.hift.inference(mel, finalize=True)[0]

    def _window_eager(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.hift.decode(mel, source, finalize=False)

    def offline(self, mel: torch.Tensor) -> torch.Tensor:
        fn = self._offline if mel.shape[0] >= COMPILED_HIFT_MIN_ROWS else self._offline_eager
        return fn(mel)

    def stream_window(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        fn = self._window if mel.shape[0] >= COMPILED_HIFT_MIN_ROWS else self._window_eager
        return fn(mel, source)


def compiled_backends(models) -> StageBackends:
    """StageBackends running the DiT calls through the compiled estimator (no buckets, no CUDA graphs: the CPU path;
    on CUDA `cuda_graph_backends(..., compile=True)` captures the compiled estimator per bucket instead)."""
    est = CompiledDiT.of(models.flow.estimator)
    return StageBackends(dit_stream=est, dit_offline=est, name="compiled")


def compiled_graph_count() -> int:
    """Graphs torch.compile has compiled in this process so far (all functions). A compile while serving stalls every
    request in flight for as long as it takes (a minute for the full-size DiT on an H200), so the scheduler reports
    how many happened since it started (`stats()["compiles_since_start"]`) and the benchmark logs them per cell."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def save_compile_cache(path: str) -> int:
    """Write Inductor's compiled artifacts of this process to `path`; returns the bytes written (0: nothing yet)."""
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return 0
    blob, _info = got
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    return len(blob)


def load_compile_cache(path: str) -> bool:
    """Pre-load artifacts written by `save_compile_cache` (same torch version and GPU) so the next compiles hit."""
    if not os.path.isfile(path):
        raise InputError(f"compile cache not found: {path}")
    with open(path, "rb") as f:
        blob = f.read()
    return torch.compiler.load_cache_artifacts(blob) is not None


# ---------------------------------------------------------------- the compile cache as an engine set

COMPILE_CACHE_FILE = "compile_cache.bin"


def device_name(device) -> str:
    """What a compile cache is tied to besides the torch version: the GPU model (Inductor tunes and emits code per
    architecture), or "cpu"."""
    d = torch.device(device)
    if d.type == "cuda":
        return torch.cuda.get_device_name(d)
    return "cpu"


def _sha256(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_engine_set_cache(folder: str, entry: dict, device) -> float:
    """Check a compiled engine set's cache entry against this machine (torch version, GPU model, file digest) and
    pre-load it; returns the seconds the load took. EngineSetError says what differs (rebuild the set)."""
    import time

    from ...engines.errors import EngineSetError

    if not entry or "file" not in entry:
        raise EngineSetError(f"{folder}: a compiled engine set without a compile_cache entry in its manifest")
    path = os.path.join(folder, entry["file"])
    if not os.path.isfile(path):
        raise EngineSetError(f"compile cache missing: {path}")
    if entry.get("torch") != torch.__version__:
        raise EngineSetError(f"compile cache {path} was written by torch {entry.get('torch')}, this is "
                             f"{torch.__version__}: rebuild it with `trtbuild build --backend compiled`")
    here = device_name(device)
    if entry.get("device_name") != here:
        raise EngineSetError(f"compile cache {path} was written on {entry.get('device_name')!r}, this device is "
                             f"{here!r}: rebuild it with `trtbuild build --backend compiled`")
    if entry.get("sha256") and _sha256(path) != entry["sha256"]:
        raise EngineSetError(f"compile cache {path} does not match its manifest digest (modified or truncated)")
    t0 = time.perf_counter()
    load_compile_cache(path)
    return time.perf_counter() - t0
