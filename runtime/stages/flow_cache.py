"""Flow prefix KV cache: streaming DiT hops compute only their new frames (exact).

In streaming mode (finalize=False) the DiT is causal at chunk granularity (the reference note flow-prefix-cache.md):
per-frame input Linear, two left-padded causal convolutions (kernel 31) in the conv position embedding,
block-causal attention in 50-frame chunks with all left chunks visible, RoPE at absolute positions, per-frame
AdaLN / FF / output projection / Euler update / CFG mix, the fixed noise column j for frame j, and tokens -> mu with
3 look-ahead tokens that give no frames (tokens are append-only, so a frame's mu never changes once it exists). So the
post-RoPE K/V of every (Euler step, layer, CFG row) of a frame lying in a whole chunk that an earlier hop computed,
the two convolutions' last 30 input frames at that chunk boundary and the frame's final mel are exactly what a later
hop would recompute. A request keeps them (`FlowPrefixState`) and each non-final hop computes only the frames past its
committed prefix (`Flow.inference_batch` with `FlowInput.cache`). Only whole chunks are committed (a partial last
chunk would see more keys in the next hop). Before reusing a prefix a hop checks that what the prefix frames were
computed from (token ids, prompt mel, speaker row, model and noise) equals its own inputs, so a changed input can never
reuse stale K/V (it drops the cache and recomputes, counted as `invalidations`).

Speaker prompt cache: the chunks that lie wholly before frame token_mel_ratio * (P - look_ahead) of a P-token prompt
depend only on the prompt mel, the prompt tokens, the speaker embedding, the noise and the weights. The first cached
hop of a request commits those chunks as a shared `PromptEntry` keyed by a content hash of those tensors and the model
(weights fingerprint, noise, dtype); the next request with the same prompt starts from it (its first hop then computes
~50 new frames instead of ~200). Entries are refcounted while requests use them and evicted LRU when the pool needs
room.

Memory: per frame 2 (K, V) x depth x n_timesteps x 2 CFG rows x dim elements (full size bf16: 1.8 MB), plus per request
2 convs x n_timesteps x 2 rows x 30 x dim (full size bf16: 2.5 MB) of conv tails. `FlowCachePool(budget_bytes)` charges
every commit; when a commit does not fit (after evicting unused prompt entries) the hop still runs against what the
request already has but commits nothing, and a request with nothing cached runs today's whole-history hop through the
pipeline's estimator (engine / CUDA graphs); both count as `fallback_hops`.

The final hop stays upstream's full-attention pass over everything (a streaming final loses quality) and frees the
request's cache (`FlowPrefixState.close`).

Engines: `BucketedDiT` / CUDA-graph runners run whole-history calls only, so a cached hop runs the eager DiT's
`forward_cached` (torch.compile'd when the pipeline's DiT is compiled). A graph / engine for cached hops would need
the prefix as extra inputs: per (step, layer) K/V in a paged pool with a page table per row (static buffers, as
sglang-omni's prefix_cuda_graph), prefix lengths, RoPE offsets and conv tails, with buckets over (rows, new frames,
prefix pages).
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from ..models.flow import cfg_euler_step


# ------------------------------------------------------------------------------------------------------- segments

@dataclass
class Segment:
    """Committed frames [start, start + n) of one stream: k / v [steps, depth, 2 (cond, uncond), n, dim] (post-RoPE
    keys, values), mel [80, n] (the solved mel), cond [80, n] (the prompt-mel conditioning they were computed from)."""
    start: int
    k: torch.Tensor
    v: torch.Tensor
    mel: torch.Tensor
    cond: torch.Tensor

    @property
    def n(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.mel, self.cond))


@dataclass
class Prefix:
    """A committed prefix: segments covering frames [0, frames), the conv tails at `frames` (tail1 / tail2
    [steps, 2, K-1, dim]), what it was computed from: the speaker embedding (embedding [192]), the token ids (prompt +
    generated, at least the frames' tokens and their look-ahead) and the model fingerprint; `digest`: the
    `prompt_digest` of the prompt it was computed with, when its hop knew it (then `tokens` are on the host)."""
    segments: list
    tail1: torch.Tensor
    tail2: torch.Tensor
    embedding: torch.Tensor
    tokens: torch.Tensor
    model: str = ""
    digest: Optional[str] = None

    @property
    def frames(self) -> int:
        return sum(s.n for s in self.segments)


@dataclass
class PromptEntry:
    """A speaker's shared prompt prefix (in the pool's LRU, refcounted by the requests that use it)."""
    key: str
    prefix: Prefix
    nbytes: int
    refs: int = 0


# ---------------------------------------------------------------------------------------------------------- pool

class FlowCachePool:
    """Memory budget (bytes) and counters shared by the requests' prefix states and the speaker prompt entries."""

    def __init__(self, budget_bytes: int, prompt_cache: bool = True):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"flow cache budget must be a non-negative int of bytes, got {budget_bytes!r}")
        self.budget = budget_bytes
        self.prompt_cache = prompt_cache
        self._lock = threading.RLock()
        self.used = 0
        self._prompts: OrderedDict[str, PromptEntry] = OrderedDict()
        self.counts = dict(frames_computed=0, frames_reused=0, cached_hops=0, whole_hops=0, fallback_hops=0,
                           invalidations=0, prompt_hits=0, prompt_misses=0, prompt_evictions=0, peak_bytes=0)

    # ------------------------------------------------------------------------------------------------ budget
    def reserve(self, nbytes: int) -> bool:
        """Charge nbytes if they fit, evicting least recently used prompt entries no request uses."""
        with self._lock:
            if self.used + nbytes > self.budget:
                for key in [k for k, e in self._prompts.items() if e.refs == 0]:
                    if self.used + nbytes <= self.budget:
                        break
                    self.used -= self._prompts.pop(key).nbytes
                    self.counts["prompt_evictions"] += 1
            if self.used + nbytes > self.budget:
                return False
            self.used += nbytes
            self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self.used)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes

    def count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "bytes_used": self.used, "budget_bytes": self.budget,
                    "prompt_entries": len(self._prompts)}

    # ------------------------------------------------------------------------------------------ prompt entries
    def prompt_get(self, key: str) -> Optional[PromptEntry]:
        with self._lock:
            e = self._prompts.get(key)
            if e is not None:
                self._prompts.move_to_end(key)
                e.refs += 1
            self.counts["prompt_hits" if e is not None else "prompt_misses"] += 1
            return e

    def prompt_put(self, key: str, prefix: Prefix) -> Optional[PromptEntry]:
        """Register a prompt prefix (charged to the pool; None when it does not fit or the key exists)."""
        nbytes = prefix_nbytes(prefix)
        with self._lock:
            if key in self._prompts or not self.reserve(nbytes):
                return None
            e = self._prompts[key] = PromptEntry(key, prefix, nbytes, refs=1)
            return e

    def prompt_unref(self, e: PromptEntry) -> None:
        with self._lock:
            e.refs -= 1

    def clear_prompts(self) -> None:
        """Drop every prompt entry no request uses (e.g. after the weights or the noise changed)."""
        with self._lock:
            for key in [k for k, e in self._prompts.items() if e.refs == 0]:
                self.used -= self._prompts.pop(key).nbytes

    def new_state(self) -> "FlowPrefixState":
        return FlowPrefixState(self)


def prefix_nbytes(p: Prefix) -> int:
    return sum(s.nbytes for s in p.segments) + (p.tail1.numel() + p.tail2.numel()) * p.tail1.element_size()


def bytes_per_frame(flow, dtype: Optional[torch.dtype] = None) -> int:
    """K/V bytes one committed frame costs (both CFG rows, every Euler step and layer)."""
    c = flow.cfg
    esize = torch.empty((), dtype=dtype or flow.rand_noise.dtype).element_size()
    return 2 * c.dit.depth * c.n_timesteps * 2 * c.dit.heads * c.dit.dim_head * esize


def _release_bytes(pool: FlowCachePool, nbytes: list, entry: list) -> None:
    """weakref finalizer of a state: give back what a state never closed still holds."""
    if nbytes[0]:
        pool.release(nbytes[0])
        nbytes[0] = 0
    if entry[0] is not None:
        pool.prompt_unref(entry[0])
        entry[0] = None


# --------------------------------------------------------------------------------------------- per-request state

class FlowPrefixState:
    """One streaming request's committed prefix. Used by one DiT call at a time (a request's hops run in order);
    `close` may come from another thread (cancel) and frees it (an in-flight hop then commits nothing)."""

    def __init__(self, pool: FlowCachePool):
        self.pool = pool
        self.prefix: Optional[Prefix] = None
        self.prompt_checked = False
        self.closed = False
        self._nbytes = [0]        # own segments + tails charged to the pool
        self._entry = [None]      # the shared prompt entry in use
        self.own_start = 0        # frames below this come from the prompt entry
        self.tails_charged = False
        self._finalizer = weakref.finalize(self, _release_bytes, pool, self._nbytes, self._entry)

    @property
    def frames(self) -> int:
        return 0 if self.prefix is None or self.closed else self.prefix.frames

    def drop(self) -> None:
        """Forget the prefix (and its pool charge); the next hop starts from scratch."""
        _release_bytes(self.pool, self._nbytes, self._entry)
        self.prefix = None
        self.own_start = 0
        self.tails_charged = False

    def close(self) -> None:
        self.closed = True
        self.drop()

    # used by flow.Flow._solve_cached ------------------------------------------------------------------------
    def attach_prompt(self, entry: PromptEntry) -> None:
        self._entry[0] = entry
        p = entry.prefix
        self.prefix = Prefix(list(p.segments), p.tail1, p.tail2, p.embedding, p.tokens, p.model, p.digest)
        self.own_start = p.frames

    def add_bytes(self, n: int) -> None:
        self._nbytes[0] += n

    @property
    def uses_prompt_entry(self) -> bool:
        return self._entry[0] is not None


# ------------------------------------------------------------------------------------------------- prompt keys

def _tensor_digest(h, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    h.update(str((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _version(t: torch.Tensor):
    """(storage, in-place version) of a tensor: changes when it is replaced or written in place."""
    try:
        return t.data_ptr(), t._version
    except RuntimeError:  # inference tensors keep no version counter
        return t.data_ptr(), None


def model_fingerprint(flow) -> str:
    """Content fingerprint of a Flow (every parameter: shape, dtype and a strided sample of values; the noise
    columns' sample; dtype/device). Memoized per parameter version, so in-place weight loads refresh it."""
    versions = tuple(_version(p) for p in flow.parameters()) + (_version(flow.rand_noise),)
    memo = getattr(flow, "_cosytrt_fingerprint", None)
    if memo is not None and memo[0] == versions:
        return memo[1]
    h = hashlib.sha256(str(flow.rand_noise.device).encode())
    with torch.no_grad():
        for name, p in flow.named_parameters():
            h.update(name.encode())
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            _tensor_digest(h, flat[::step])
            _tensor_digest(h, flat.float().sum().reshape(1))
        noise = flow.rand_noise[0]
        _tensor_digest(h, noise[:, ::max(1, noise.shape[1] // 4096)])
        _tensor_digest(h, noise.float().sum().reshape(1))
    fp = h.hexdigest()
    flow._cosytrt_fingerprint = (versions, fp)
    return fp


def prompt_digest(prompt_token: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor) -> str:
    """Content hash of a flow prompt (token ids, mel, speaker embedding: exact bytes). Computed where the tensors are
    on the host (the scheduler's frontend step), it spares the DiT thread a device->host read per request."""
    h = hashlib.sha256()
    for t in (prompt_token.reshape(-1).long(), prompt_feat.reshape(-1, prompt_feat.shape[-1]), embedding.reshape(-1)):
        _tensor_digest(h, t)
    return h.hexdigest()


def prompt_key(flow, prompt_token: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor,
               digest: Optional[str] = None) -> str:
    """Content hash of the prompt tensors (exact bytes: `prompt_digest`, or the one given) and the model
    fingerprint."""
    if digest is None:
        digest = prompt_digest(prompt_token, prompt_feat, embedding)
    return hashlib.sha256((model_fingerprint(flow) + digest).encode()).hexdigest()


def prompt_cacheable_frames(flow, n_prompt_tokens: int) -> int:
    """Frames of a P-token prompt that depend on the prompt only: whole chunks before token_mel_ratio * (P - look_ahead)
    (a prompt token's mu needs the look_ahead tokens after it, and a chunk's frames see the whole chunk)."""
    c = flow.cfg
    chunk = c.dit.static_chunk_size
    limit = c.token_mel_ratio * max(0, n_prompt_tokens - c.pre_lookahead_len)
    return (limit // chunk) * chunk


def default_budget(device) -> int:
    """The pool budget when none is configured: 40 % of the GPU's memory, but never more than what is free now less
    a reserve for the stages' working memory (a tenth of the GPU, at least 4 GiB); 1 GiB on CPU. Taken when the
    scheduler starts, after its graphs are captured. (sglang-omni caps its pool at 24 GiB / 25 %: on the H200 that
    pool filled at 8 req/s of mixed-length streams and 62 hops fell back to whole-history, BENCHMARKS.md run 28.)"""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = max(4 << 30, total // 10)
        return int(max(0, min(total * 2 // 5, free - reserve)))
    return 1 << 30
