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

Storage (`PageStore`: allocated once per pool, by the scheduler before it captures the cached-hop graphs, which
bake in its addresses; else by the pool's first hop):
K/V in pages of one attention chunk (50 frames) holding every (Euler step, layer, CFG row) of those frames, and the
conv tails in slots. A prefix is a page table (page j = frames [50 j, 50 j + 50)) plus a tail slot, so a hop loads its
prefix with one gather per K and V inside its estimator call (no per-segment copies from the host per Euler step)
and writes its new frames' K/V straight into the pages it reserved. Page 0 and tail slot 0 stay zero (what padding
reads), page 1 and tail slot 1 are written by padding and uncommitted frames and never read. A hop reserves the
pages of the frames it will commit and a fresh tail slot when it is planned; the request's previous tail slot is
given back when the hop commits, so a hop that fails leaves the committed prefix as it was.

Memory: per frame 2 (K, V) x depth x n_timesteps x 2 CFG rows x dim elements (full size bf16: 1.8 MB; a page 90 MB),
plus per tail slot 2 convs x n_timesteps x 2 rows x 30 x dim (full size bf16: 2.5 MB). `FlowCachePool(budget_bytes)`
charges every page and tail slot a hop reserves against the budget; when a hop's commit does not fit (after evicting
unused prompt entries) it still runs against what the request already has but commits nothing, and a request with
nothing cached runs today's whole-history hop through the pipeline's estimator (engine / CUDA graphs); both count as
`fallback_hops`. A hop the scheduler knows to be the last before its request's final (`FlowInput.commit` False)
commits nothing either (`uncommitted_last_hops`): the final reads no prefix.

The final hop stays upstream's full-attention pass over everything (a streaming final loses quality) and frees the
request's cache (`FlowPrefixState.close`).

Engines: `BucketedDiT` / engine runners run whole-history calls only; cached hops run `DiT.forward_cached` (eager or
torch.compile'd) through `flow_hop_calls` (eagerly, or a CUDA graph per (requests, new frames, prefix) bucket that
gathers the prefix from the page table inside the graph, as sglang-omni's prefix_cuda_graph does).
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
from ..models.versions import tensor_version


# ------------------------------------------------------------------------------------------------------- segments

ZERO, TRASH = 0, 1   # page / tail slot that stays zero (read by padding) and the one padding writes (never read)


@dataclass
class Segment:
    """Committed frames [start, start + n) of one stream: mel [80, n] (the solved mel) and cond [80, n] (the
    prompt-mel conditioning they were computed from). Their K/V are in the prefix's pages."""
    start: int
    mel: torch.Tensor
    cond: torch.Tensor

    @property
    def n(self) -> int:
        return self.mel.shape[1]


@dataclass
class Prefix:
    """A committed prefix: segments covering frames [0, frames), `pages` (page j of the pool's `PageStore` holds the
    K/V of frames [j C, (j + 1) C) of every Euler step, layer and CFG row; C = the attention chunk), `tail` (the tail
    slot with the conv input tails at `frames`), what it was computed from: the speaker embedding (embedding [192]),
    the token ids (prompt + generated, at least the frames' tokens and their look-ahead) and the model fingerprint;
    `digest`: the `prompt_digest` of the prompt it was computed with, when its hop knew it (then `tokens` are on
    the host)."""
    segments: list
    pages: list
    tail: int
    embedding: torch.Tensor
    tokens: torch.Tensor
    model: str = ""
    digest: Optional[str] = None

    @property
    def frames(self) -> int:
        return sum(s.n for s in self.segments)


@dataclass
class PromptEntry:
    """A speaker's shared prompt prefix (in the pool's LRU, refcounted by the requests that use it); it owns the
    prefix's pages and tail slot."""
    key: str
    prefix: Prefix
    refs: int = 0


# ------------------------------------------------------------------------------------------------------- storage

class PageStore:
    """The device memory of a pool's cached K/V and conv tails, fixed once allocated (CUDA graphs capture it).

    k / v [depth, pages x steps x 2 x C, D]: row ((page x steps + step) x 2 + cfg row) x C + frame of layer l holds
    that frame's post-RoPE key / value. tails [slots x steps x 2 x 2, K-1, dim]: row ((slot x steps + step) x 2 +
    conv) x 2 + cfg row holds a convolution's last K-1 input frames. Page / slot 0 is zero, 1 is the write sink."""

    def __init__(self, flow, pages: int, tails: int):
        c, dit = flow.cfg, flow.estimator
        self.device, self.dtype = flow.rand_noise.device, flow.rand_noise.dtype
        self.steps, self.depth, self.chunk = c.n_timesteps, c.dit.depth, c.dit.static_chunk_size
        self.kv_dim, self.dim = c.dit.heads * c.dit.dim_head, c.dit.dim
        self.k1 = dit.input_embed.conv_pos_embed.kernel_size - 1
        self.pages, self.tail_slots = pages + 2, tails + 2
        rows = self.pages * self.steps * 2 * self.chunk
        with torch.inference_mode():
            self.k = torch.empty(self.depth, rows, self.kv_dim, device=self.device, dtype=self.dtype)
            self.v = torch.empty_like(self.k)
            self.tails = torch.empty(self.tail_slots * self.steps * 4, self.k1, self.dim, device=self.device,
                                     dtype=self.dtype)
            for t in (self.k, self.v):
                t[:, :2 * self.steps * 2 * self.chunk].zero_()  # the zero page and the sink (finite values)
            self.tails[:2 * self.steps * 4].zero_()

    @staticmethod
    def sizes(flow) -> tuple[int, int]:
        """(bytes of one page, bytes of one tail slot) for this flow."""
        c = flow.cfg
        esize = torch.empty((), dtype=flow.rand_noise.dtype).element_size()
        k1 = flow.estimator.input_embed.conv_pos_embed.kernel_size - 1
        return bytes_per_frame(flow) * c.dit.static_chunk_size, c.n_timesteps * 2 * 2 * k1 * c.dit.dim * esize

    def fits(self, flow) -> bool:
        c = flow.cfg
        return (flow.rand_noise.device, flow.rand_noise.dtype, c.n_timesteps, c.dit.depth, c.dit.static_chunk_size,
                c.dit.heads * c.dit.dim_head, c.dit.dim) == (self.device, self.dtype, self.steps, self.depth,
                                                            self.chunk, self.kv_dim, self.dim)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.tails))


# ---------------------------------------------------------------------------------------------------------- pool

class FlowCachePool:
    """Memory budget (bytes), the page store and counters shared by the requests' prefix states and the speaker
    prompt entries."""

    def __init__(self, budget_bytes: int, prompt_cache: bool = True):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"flow cache budget must be a non-negative int of bytes, got {budget_bytes!r}")
        self.budget = budget_bytes
        self.prompt_cache = prompt_cache
        self._lock = threading.RLock()
        self.used = 0
        self.store: Optional[PageStore] = None
        self.closed = False
        self.page_bytes = self.tail_bytes = 0
        self._free_pages: list = []
        self._free_tails: list = []
        self._prompts: OrderedDict[str, PromptEntry] = OrderedDict()
        self.counts = dict(frames_computed=0, frames_reused=0, cached_hops=0, whole_hops=0, fallback_hops=0,
                           uncommitted_last_hops=0, invalidations=0, prompt_hits=0, prompt_misses=0,
                           prompt_evictions=0, peak_bytes=0)

    # ------------------------------------------------------------------------------------------------ storage
    def storage(self, flow) -> Optional[PageStore]:
        """The pool's page store for `flow`, allocated on first use: as many pages as the budget holds and a tail
        slot per page plus 64 (a tail slot costs ~3 % of a page; a request holds one per committed prefix, one
        more while a hop runs). None when the budget holds no page."""
        with self._lock:
            if self.closed:
                return None
            if self.store is None:
                page, tail = PageStore.sizes(flow)
                pages = self.budget // page
                if pages < 1 or self.budget < page + tail:
                    return None
                self.page_bytes, self.tail_bytes = page, tail
                self.store = PageStore(flow, pages, min(self.budget // tail, pages + 64))
                self._free_pages = list(range(self.store.pages - 1, 1, -1))
                self._free_tails = list(range(self.store.tail_slots - 1, 1, -1))
            elif not self.store.fits(flow):
                raise ValueError("this flow cache pool's pages were made for another flow (device, dtype or size)")
            return self.store

    def close(self) -> None:
        """Free the page store for good (the requests' prefixes and prompt entries go with it; later hops run whole
        and page ids given back later are dropped)."""
        with self._lock:
            self.closed = True
            self._prompts.clear()
            self.store = None
            self._free_pages, self._free_tails = [], []
            self.used = 0

    # ------------------------------------------------------------------------------------------------ budget
    def reserve(self, pages: int, tails: int) -> Optional[tuple[list, list]]:
        """Take `pages` pages and `tails` tail slots if they fit the budget and the store, evicting least recently
        used prompt entries no request uses; (page ids, slot ids) or None."""
        with self._lock:
            if self.store is None:
                return None
            nbytes = pages * self.page_bytes + tails * self.tail_bytes

            def short() -> bool:
                return (self.used + nbytes > self.budget or len(self._free_pages) < pages
                        or len(self._free_tails) < tails)

            if short():
                for key in [k for k, e in self._prompts.items() if e.refs == 0]:
                    if not short():
                        break
                    e = self._prompts.pop(key)
                    self._free(e.prefix.pages, [e.prefix.tail])
                    self.counts["prompt_evictions"] += 1
            if short():
                return None
            self.used += nbytes
            self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self.used)
            return [self._free_pages.pop() for _ in range(pages)], [self._free_tails.pop() for _ in range(tails)]

    def _free(self, pages: list, tails: list) -> None:
        self.used -= len(pages) * self.page_bytes + len(tails) * self.tail_bytes
        self._free_pages.extend(pages)
        self._free_tails.extend(tails)

    def release(self, pages: list, tails: list) -> None:
        """Give back pages and tail slots taken by `reserve` (ids of a store that was closed are dropped)."""
        with self._lock:
            if self.store is not None:
                self._free([p for p in pages if p >= 2], [t for t in tails if t >= 2])

    def count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def stats(self) -> dict:
        with self._lock:
            return {**self.counts, "bytes_used": self.used, "budget_bytes": self.budget,
                    "prompt_entries": len(self._prompts),
                    "pages_free": len(self._free_pages), "pages": 0 if self.store is None else self.store.pages - 2}

    # ------------------------------------------------------------------------------------------ prompt entries
    def prompt_get(self, key: str) -> Optional[PromptEntry]:
        with self._lock:
            e = self._prompts.get(key)
            if e is not None:
                self._prompts.move_to_end(key)
                e.refs += 1
            self.counts["prompt_hits" if e is not None else "prompt_misses"] += 1
            return e

    def prompt_register(self, key: str, prefix: Prefix) -> Optional[PromptEntry]:
        """Register a prompt prefix whose pages and tail slot the caller reserved (refs 1); None when the key
        exists already (the caller keeps its pages)."""
        with self._lock:
            if key in self._prompts:
                return None
            e = self._prompts[key] = PromptEntry(key, prefix, refs=1)
            return e

    def prompt_unref(self, e: PromptEntry) -> None:
        with self._lock:
            e.refs -= 1

    def clear_prompts(self) -> None:
        """Drop every prompt entry no request uses (e.g. after the weights or the noise changed)."""
        with self._lock:
            for key in [k for k, e in self._prompts.items() if e.refs == 0]:
                e = self._prompts.pop(key)
                self._free(e.prefix.pages, [e.prefix.tail])

    def new_state(self) -> "FlowPrefixState":
        return FlowPrefixState(self)


def bytes_per_frame(flow, dtype: Optional[torch.dtype] = None) -> int:
    """K/V bytes one committed frame costs (both CFG rows, every Euler step and layer)."""
    c = flow.cfg
    esize = torch.empty((), dtype=dtype or flow.rand_noise.dtype).element_size()
    return 2 * c.dit.depth * c.n_timesteps * 2 * c.dit.heads * c.dit.dim_head * esize


def _release_owned(pool: FlowCachePool, owned: dict) -> None:
    """weakref finalizer of a state (and `drop`): give back the pages / tail slot it owns and its prompt entry."""
    if owned["pages"] or owned["tails"]:
        pool.release(owned["pages"], owned["tails"])
        owned["pages"], owned["tails"] = [], []
    if owned["entry"] is not None:
        pool.prompt_unref(owned["entry"])
        owned["entry"] = None


# --------------------------------------------------------------------------------------------- per-request state

class FlowPrefixState:
    """One streaming request's committed prefix. Used by one DiT call at a time (a request's hops run in order);
    `close` may come from another thread (cancel) and frees it (an in-flight hop then commits nothing)."""

    def __init__(self, pool: FlowCachePool):
        self.pool = pool
        self.prefix: Optional[Prefix] = None
        self.prompt_checked = False
        self.closed = False
        self._owned = {"pages": [], "tails": [], "entry": None}  # own pages / tail slot, the prompt entry in use
        self._finalizer = weakref.finalize(self, _release_owned, pool, self._owned)

    @property
    def frames(self) -> int:
        return 0 if self.prefix is None or self.closed else self.prefix.frames

    def drop(self) -> None:
        """Forget the prefix (and give back what it holds); the next hop starts from scratch."""
        _release_owned(self.pool, self._owned)
        self.prefix = None

    def close(self) -> None:
        self.closed = True
        self.drop()

    # used by flow_hops ---------------------------------------------------------------------------------------
    def attach_prompt(self, entry: PromptEntry) -> None:
        self.use_entry(entry)
        p = entry.prefix
        self.prefix = Prefix(list(p.segments), list(p.pages), p.tail, p.embedding, p.tokens, p.model, p.digest)

    def use_entry(self, entry: PromptEntry) -> None:
        """The prompt entry this request's first hop registered (its reference is this state's)."""
        self._owned["entry"] = entry

    def own(self, pages: list, tails: list) -> None:
        """Take ownership of reserved pages / tail slots (they are given back with the state)."""
        self._owned["pages"].extend(pages)
        self._owned["tails"].extend(tails)

    def disown_tail(self, slot: int) -> None:
        """Give back an own tail slot a newer one replaced (the commit that replaced it has happened)."""
        if slot in self._owned["tails"]:
            self._owned["tails"].remove(slot)
            self.pool.release([], [slot])

    @property
    def uses_prompt_entry(self) -> bool:
        return self._owned["entry"] is not None


# ------------------------------------------------------------------------------------------------- prompt keys

def _tensor_digest(h, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    h.update(str((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def model_fingerprint(flow) -> str:
    """Content fingerprint of a Flow (every parameter: shape, dtype and a strided sample of values; the noise
    columns' sample; dtype/device). Memoized per parameter version, so in-place weight loads refresh it."""
    versions = tuple(tensor_version(p) for p in flow.parameters()) + (tensor_version(flow.rand_noise),)
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


def default_budget(device, graphs_pending: bool = False) -> int:
    """The pool budget when none is configured: 40 % of the GPU's memory, but never more than what is free now less
    a reserve for the stages' working memory (a tenth of the GPU, at least 4 GiB; a quarter, at least 8 GiB, when
    the cached-hop graphs are still to be captured: they are captured after the pool's pages, whose addresses they
    bake in, and take their working memory from what is left); 1 GiB on CPU. (sglang-omni caps its pool at 24 GiB /
    25 %: on the H200 that pool filled at 8 req/s of mixed-length streams and 62 hops fell back to whole-history,
    BENCHMARKS.md run 28.)"""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = max(8 << 30, total // 4) if graphs_pending else max(4 << 30, total // 10)
        return int(max(0, min(total * 2 // 5, free - reserve)))
    return 1 << 30
