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
    generated, at least the frames' tokens and their look-ahead) and the model fingerprint."""
    segments: list
    tail1: torch.Tensor
    tail2: torch.Tensor
    embedding: torch.Tensor
    tokens: torch.Tensor
    model: str = ""

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
        self.prefix = Prefix(list(p.segments), p.tail1, p.tail2, p.embedding, p.tokens, p.model)
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


def prompt_key(flow, prompt_token: torch.Tensor, prompt_feat: torch.Tensor, embedding: torch.Tensor) -> str:
    """Content hash of the prompt tensors (exact bytes) and the model fingerprint."""
    h = hashlib.sha256(model_fingerprint(flow).encode())
    for t in (prompt_token.long(), prompt_feat, embedding):
        _tensor_digest(h, t)
    return h.hexdigest()


def prompt_cacheable_frames(flow, n_prompt_tokens: int) -> int:
    """Frames of a P-token prompt that depend on the prompt only: whole chunks before token_mel_ratio * (P - look_ahead)
    (a prompt token's mu needs the look_ahead tokens after it, and a chunk's frames see the whole chunk)."""
    c = flow.cfg
    chunk = c.dit.static_chunk_size
    limit = c.token_mel_ratio * max(0, n_prompt_tokens - c.pre_lookahead_len)
    return (limit // chunk) * chunk


# ------------------------------------------------------------------------------------------- estimator choice

def cached_dit_fn(flow, estimator=None):
    """The function cached hops run: the eager DiT's forward_cached, or its torch.compile'd form when the pipeline's
    estimator is compiled (CompiledDiT, or a bucketed runner whose eager fallback is one)."""
    dit = flow.estimator
    est = estimator
    while est is not None and not _is_compiled(est) and hasattr(est, "eager"):
        est = est.eager
    if est is not None and _is_compiled(est):
        from .compiled import compile_fn

        return compile_fn(dit.forward_cached)
    return dit.forward_cached


def _is_compiled(est) -> bool:
    return type(est).__name__ == "CompiledDiT"


# ------------------------------------------------------------------------------------------------- cached hops

@dataclass
class HopPlan:
    """One row of a cached hop: compute frames [start, row.frames) after `prefix`; then commit frames up to
    commit_to (own segment from own_from; with split > 0 frames [0, split) become the prompt entry `key`)."""
    index: int
    state: FlowPrefixState
    row: object                      # flow.FlowRow
    start: int
    prefix: Optional[Prefix]
    commit_to: int
    own_from: int
    own_bytes: int = 0               # reserved in the pool for the own segment (+ tails)
    split: int = 0
    key: Optional[str] = None
    prompt_bytes: int = 0            # reserved for the prompt entry
    model: str = ""
    tokens: Optional[torch.Tensor] = None  # the row's token ids (prompt + generated)
    embedding: Optional[torch.Tensor] = None  # the row's speaker embedding [192]


def _sizes(flow):
    c = flow.cfg
    dit = flow.estimator
    esize = torch.empty((), dtype=flow.rand_noise.dtype).element_size()
    kv = c.dit.heads * c.dit.dim_head
    frame = (2 * c.dit.depth * c.n_timesteps * 2 * kv + 2 * c.output_size) * esize
    tails = 2 * c.n_timesteps * 2 * (dit.input_embed.conv_pos_embed.kernel_size - 1) * c.dit.dim * esize
    return frame, tails


def _row_tokens(inp) -> torch.Tensor:
    return torch.cat((inp.prompt_token.reshape(-1), inp.token.reshape(-1))).long()


def _tokens_needed(flow, frames: int) -> int:
    """Token ids that determine mel frames [0, frames): their tokens and the look-ahead after them."""
    return -(-frames // flow.cfg.token_mel_ratio) + flow.cfg.pre_lookahead_len


def _matches(flow, prefix: Prefix, inp, row, model: str) -> bool:
    """Were the prefix frames computed from this row's inputs (model and noise, token ids, speaker embedding,
    prompt mel)? Then their K/V are what the row would compute. (mu itself is compared through its token ids: the
    token encoder's convolutions may round differently at another length.)"""
    n = prefix.frames
    if prefix.model != model or n >= row.frames:
        return False
    if not torch.equal(prefix.embedding, inp.embedding.reshape(-1).to(prefix.embedding)):
        return False
    need = _tokens_needed(flow, n)
    tokens = _row_tokens(inp).to(prefix.tokens.device)
    if tokens.numel() < need or prefix.tokens.numel() < need or not torch.equal(tokens[:need], prefix.tokens[:need]):
        return False
    cond = torch.cat([s.cond for s in prefix.segments], dim=1)
    return torch.equal(cond, row.cond[:, :n])


def plan_hops(flow, inputs, rows):
    """Decide, per cached non-final row (FlowInput with .cache, its FlowRow), what it computes and commits, reserving
    pool memory. Returns (plans, whole): `whole` are indices that run the whole-history call instead."""
    frame_bytes, tail_bytes = _sizes(flow)
    chunk = flow.cfg.dit.static_chunk_size
    model = model_fingerprint(flow)
    plans, whole = [], []
    for k, (inp, row) in enumerate(zip(inputs, rows)):
        st: FlowPrefixState = inp.cache
        pool = st.pool
        if st.prefix is not None and not _matches(flow, st.prefix, inp, row, model):
            st.drop()
            pool.count(invalidations=1)
        key = None
        if st.prefix is None and not st.prompt_checked and pool.prompt_cache:
            st.prompt_checked = True
            key = prompt_key(flow, inp.prompt_token, inp.prompt_feat, inp.embedding)
            entry = pool.prompt_get(key)
            if entry is not None:
                if _matches(flow, entry.prefix, inp, row, model):
                    st.attach_prompt(entry)
                else:
                    pool.prompt_unref(entry)
                key = None
        start = st.frames
        if start >= row.frames:  # no new frame (not an upstream hop schedule): recompute it whole
            whole.append(k)
            pool.count(whole_hops=1, frames_computed=row.frames)
            continue
        commit_to = (row.frames // chunk) * chunk
        split = prompt_bytes = 0
        if key is not None and start == 0:
            split = prompt_cacheable_frames(flow, int(inp.prompt_token.numel()))
            if not 0 < split <= commit_to:
                split = 0
            elif pool.reserve(split * frame_bytes + tail_bytes):
                prompt_bytes = split * frame_bytes + tail_bytes
            else:
                split = 0
        own_from = max(start, split)
        own_bytes = 0
        if commit_to > own_from:
            own_bytes = (commit_to - own_from) * frame_bytes + (0 if st.tails_charged else tail_bytes)
            if not pool.reserve(own_bytes):
                pool.count(fallback_hops=1)
                own_bytes = 0
                commit_to = max(start, split)
                if commit_to == 0:  # nothing cached, nothing to commit: today's whole-history hop
                    whole.append(k)
                    pool.count(whole_hops=1, frames_computed=row.frames)
                    continue
        else:
            commit_to = max(commit_to, start)
        plans.append(HopPlan(k, st, row, start, st.prefix, commit_to, own_from, own_bytes, split,
                             key if split else None, prompt_bytes, model, _row_tokens(inp),
                             inp.embedding.reshape(-1).to(device=row.spks.device, dtype=row.spks.dtype).clone()))
        pool.count(cached_hops=1, frames_computed=row.frames - start, frames_reused=start)
    return plans, whole


def _release_plan(p: HopPlan) -> None:
    if p.own_bytes:
        p.state.pool.release(p.own_bytes)
        p.own_bytes = 0
    if p.prompt_bytes:
        p.state.pool.release(p.prompt_bytes)
        p.prompt_bytes = 0


def release_plans(plans: list) -> None:
    """Give back the pool reservations of plans that will not run (the call failed)."""
    for p in plans:
        _release_plan(p)


def solve_cached(flow, plans: list, fn) -> list:
    """The 10 Euler steps with CFG for the planned rows' new frames only (`fn` = DiT.forward_cached or its compiled
    form), then the commits. Returns one mel [1, 80, frames] per plan (cached prefix mel + new frames), float32.
    Commits happen only after every step succeeded; on an error the reservations are given back."""
    try:
        return _solve_cached(flow, plans, fn)
    except BaseException:
        for p in plans:
            _release_plan(p)
        raise


def _gather(plans, pick, S_index: int, B: int, P: int, like: torch.Tensor):
    """Per-layer prefix K or V of one Euler step for all rows: [depth, 2B, P, D] (rows right-padded)."""
    parts = []
    for p in plans:
        segs = p.prefix.segments if p.prefix is not None else []
        parts.append(None if not segs else (pick(segs[0])[S_index] if len(segs) == 1
                                            else torch.cat([pick(s)[S_index] for s in segs], dim=2)))
    if B == 1 and parts[0] is not None:
        return parts[0]  # [depth, 2, c, D]: no copy
    L, D = like.shape[1], like.shape[-1]
    out = like.new_zeros(L, 2 * B, P, D)
    for b, a in enumerate(parts):
        if a is not None:
            out[:, b, :a.shape[2]] = a[:, 0]
            out[:, B + b, :a.shape[2]] = a[:, 1]
    return out


def _solve_cached(flow, plans: list, fn) -> list:
    cfg = flow.cfg
    dit = flow.estimator
    device, dtype = flow.rand_noise.device, flow.rand_noise.dtype
    B = len(plans)
    S, L = cfg.n_timesteps, cfg.dit.depth
    Dm, Dkv = cfg.dit.dim, cfg.dit.heads * cfg.dit.dim_head
    K1 = dit.input_embed.conv_pos_embed.kernel_size - 1
    C = cfg.output_size
    n = [p.row.frames - p.start for p in plans]
    N = max(n)
    P = max(p.start for p in plans)
    flow._check_frames(max(p.row.frames for p in plans))

    mu = torch.zeros(B, C, N, device=device, dtype=dtype)
    cond = torch.zeros_like(mu)
    x = torch.zeros_like(mu)
    mask = torch.zeros(B, 1, N, device=device, dtype=dtype)
    for b, p in enumerate(plans):
        mu[b, :, :n[b]] = p.row.mu[:, p.start:]
        cond[b, :, :n[b]] = p.row.cond[:, p.start:]
        x[b, :, :n[b]] = flow.rand_noise[0, :, p.start:p.row.frames].to(device=device, dtype=dtype)
        mask[b, :, :n[b]] = 1
    spks = torch.stack([p.row.spks for p in plans]).to(dtype)
    starts = torch.tensor([p.start for p in plans], device=device)
    offsets = torch.cat((starts, starts))
    prefix_valid = None
    if P > 0:
        prefix_valid = (torch.arange(P, device=device).unsqueeze(0) < starts.unsqueeze(1)).repeat(2, 1)
    like = torch.empty(1, L, 1, 1, Dkv, device=device, dtype=dtype)

    def tails(s: int, which: str) -> torch.Tensor:
        t = torch.zeros(2 * B, K1, Dm, device=device, dtype=dtype)
        for b, p in enumerate(plans):
            if p.prefix is not None:
                src = getattr(p.prefix, which)[s]  # [2, K1, Dm]
                t[b], t[B + b] = src[0], src[1]
        return t

    cfg_rate = cfg.inference_cfg_rate
    mask_in = torch.cat((mask, mask))
    mu_in = torch.cat((mu, torch.zeros_like(mu)))
    spks_in = torch.cat((spks, torch.zeros_like(spks)))
    cond_in = torch.cat((cond, torch.zeros_like(cond)))
    x_in = torch.empty((2 * B, C, N), device=device, dtype=dtype)
    hop_k = torch.empty(S, L, 2 * B, N, Dkv, device=device, dtype=dtype)
    hop_v = torch.empty_like(hop_k)
    # conv input tails at each row's commit point (and at the prompt split), per step: [2B rows][S] -> [K1, Dm]
    new_t = {name: [[None] * S for _ in range(B)] for name in ("t1", "t2", "p1", "p2")}

    t_span = flow.time_span(device, dtype)
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        s = step - 1
        x_in[:B] = x
        x_in[B:] = x
        t_in = t.expand(2 * B).contiguous()
        kp = vp = None
        if P > 0:
            kp = _gather(plans, lambda g: g.k, s, B, P, like)
            vp = _gather(plans, lambda g: g.v, s, B, P, like)
        v, in1, in2 = fn(x_in, mask_in, mu_in, t_in, spks_in, cond_in, offsets, kp, vp, prefix_valid,
                         tails(s, "tail1"), tails(s, "tail2"), hop_k[s], hop_v[s])
        for b, p in enumerate(plans):
            points = [(p.commit_to, "t1", "t2")] if p.commit_to > p.own_from else []
            if p.split:
                points.append((p.split, "p1", "p2"))
            for at, a1, a2 in points:  # in1/in2 row position m holds frame start - K1 + m
                m = at - p.start
                new_t[a1][b][s] = torch.stack((in1[b, m:m + K1], in1[B + b, m:m + K1]))
                new_t[a2][b][s] = torch.stack((in2[b, m:m + K1], in2[B + b, m:m + K1]))
        x, t, dt = cfg_euler_step(x, v, t, dt, step, t_span, cfg_rate)

    mels = []
    for b, p in enumerate(plans):
        segs = p.prefix.segments if p.prefix is not None else []
        mels.append(torch.cat([s.mel for s in segs] + [x[b, :, :n[b]]], dim=1).unsqueeze(0).float())
    for b, p in enumerate(plans):
        _commit(flow, p, b, B, hop_k, hop_v, x, cond, new_t)
    return mels


def _commit(flow, p: HopPlan, b: int, B: int, hop_k, hop_v, x, cond, new_t) -> None:
    st, pool = p.state, p.state.pool
    if st.closed or st.prefix is not p.prefix:  # cancelled (or changed) while the hop ran
        _release_plan(p)
        return

    def segment(a: int, e: int) -> Segment:
        i, j = a - p.start, e - p.start
        return Segment(a, torch.stack((hop_k[:, :, b, i:j], hop_k[:, :, B + b, i:j]), dim=2),
                       torch.stack((hop_v[:, :, b, i:j], hop_v[:, :, B + b, i:j]), dim=2),
                       x[b, :, i:j].clone(), cond[b, :, i:j].clone())

    def tails(a: str, c: str):
        return torch.stack(new_t[a][b]), torch.stack(new_t[c][b])

    segs = list(p.prefix.segments) if p.prefix is not None else []
    embedding = p.embedding
    t1 = t2 = None
    if p.split:
        pt1, pt2 = tails("p1", "p2")
        entry_prefix = Prefix([segment(0, p.split)], pt1, pt2, embedding,
                              p.tokens[:_tokens_needed(flow, p.split)].clone(), p.model)
        entry = None
        with pool._lock:
            if p.key not in pool._prompts:
                entry = pool._prompts[p.key] = PromptEntry(p.key, entry_prefix, p.prompt_bytes, refs=1)
        if entry is not None:
            st._entry[0] = entry
            st.own_start = p.split
        else:  # another request registered this prompt meanwhile: keep our own copy of the frames we computed
            st.add_bytes(p.prompt_bytes)
        p.prompt_bytes = 0
        segs = list(entry_prefix.segments)
        t1, t2 = pt1, pt2
    if p.commit_to > p.own_from:
        segs.append(segment(p.own_from, p.commit_to))
        t1, t2 = tails("t1", "t2")
        st.add_bytes(p.own_bytes)
        p.own_bytes = 0
        st.tails_charged = True
    if t1 is not None:
        st.prefix = Prefix(segs, t1, t2, embedding, p.tokens.clone(), p.model)


def default_budget(device) -> int:
    """The pool budget when none is configured: 25 % of the GPU's memory, at most 24 GiB (sglang-omni's choice);
    1 GiB on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(min(24 << 30, total // 4))
    return 1 << 30


def flow_rows(flow, rows, streaming: bool, estimator=None, finalize=None, pad_to=None) -> list:
    """`flow.inference_batch` for rows that may carry a prefix cache (FlowInput.cache): non-final streaming rows
    with an open cache compute only their new frames against it (`solve_cached`); the other rows (and cached rows
    the pool cannot serve) run the whole-history solve, batched, through `estimator`. One mel [1, 80, T_out] per
    row, each equal to the whole-history call within the flow's tolerance (tests/test_flow_cache.py)."""
    from ..models.flow import FlowInput

    rows = [r if isinstance(r, FlowInput) else FlowInput(*r) for r in rows]
    if isinstance(finalize, bool) or finalize is None:
        flags = [r.finalize if finalize is None else finalize for r in rows]
    else:
        flags = list(finalize)
    cached = [i for i, (r, f) in enumerate(zip(rows, flags))
              if streaming and not f and r.cache is not None and not r.cache.closed]
    kw = {} if estimator is None else {"estimator": estimator}
    if not cached:
        return flow.inference_batch(rows, streaming=streaming, finalize=flags, pad_to=pad_to, **kw)
    prepared = [flow.prepare_row(r.token, r.prompt_token, r.prompt_feat, r.embedding, f) for r, f in zip(rows, flags)]
    out: list = [None] * len(rows)
    plans, whole = plan_hops(flow, [rows[i] for i in cached], [prepared[i] for i in cached])
    whole_idx = [i for i in range(len(rows)) if i not in cached] + [cached[k] for k in whole]
    if whole_idx:
        sub = [prepared[i] for i in whole_idx]
        try:
            mu, mask, spks, cond = flow.collate(sub, pad_to)
            mel = flow.solve(mu, mask, spks, cond, streaming, estimator)
        except BaseException:
            release_plans(plans)
            raise
        for k, i in enumerate(whole_idx):
            out[i] = mel[k:k + 1, :, prepared[i].prompt_frames:prepared[i].frames]
    if plans:
        mels = solve_cached(flow, plans, cached_dit_fn(flow, estimator))
        for plan, m in zip(plans, mels):
            i = cached[plan.index]
            out[i] = m[:, :, prepared[i].prompt_frames:prepared[i].frames]
    return out
