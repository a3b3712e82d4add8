"""Cached streaming DiT hops (the flow prefix KV cache, stages/flow_cache.py): plan what each row computes and
commits, solve the 10 Euler steps over the new frames only, commit the new K/V, conv tails and mel.

`flow_rows` is the entry point: a DiT call's rows, where non-final streaming rows with an open cache go through
`plan_hops` / `solve_cached` and the rest through the flow's whole-history solve (engine / CUDA graphs). The
estimator calls of a cached hop go through `flow_hop_calls` (eager, or a CUDA graph per bucket).

The solver keeps each row's state apart (`CachedSolve`: `start_cached`, `step_cached`, `finish_cached`), so the
scheduler's step-level DiT can advance hops one Euler step at a time, each row at its own step, and let a new hop
join the next call; `solve_cached` runs the same three for a whole call.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .flow_cache import (FlowPrefixState, Prefix, PromptEntry, Segment, model_fingerprint, prompt_cacheable_frames,
                         prompt_key)
from ...engines.cuda_graphs import upload
from .flow_hop_calls import EagerHops


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
    tokens: Optional[torch.Tensor] = None  # the row's token ids (prompt + generated; on the host with a digest)
    embedding: Optional[torch.Tensor] = None  # the row's speaker embedding [192]
    digest: Optional[str] = None           # the row's prompt_digest, when the caller gave one


def _sizes(flow):
    c = flow.cfg
    dit = flow.estimator
    esize = torch.empty((), dtype=flow.rand_noise.dtype).element_size()
    kv = c.dit.heads * c.dit.dim_head
    frame = (2 * c.dit.depth * c.n_timesteps * 2 * kv + 2 * c.output_size) * esize
    tails = 2 * c.n_timesteps * 2 * (dit.input_embed.conv_pos_embed.kernel_size - 1) * c.dit.dim * esize
    return frame, tails


def _row_tokens(inp) -> torch.Tensor:
    """The row's token ids (prompt + generated): the caller's host copy when it gave one (no device read later)."""
    if inp.host_ids is not None:
        return inp.host_ids.reshape(-1).long()
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
    need = _tokens_needed(flow, n)
    if inp.prompt_digest is not None and prefix.digest == inp.prompt_digest and inp.host_ids is not None \
            and prefix.tokens.device.type == "cpu":
        # same prompt tensors by content (the digest covers the prompt ids, mel = the prefix's cond, and the
        # speaker embedding): only the generated ids remain, compared on the host
        tokens = _row_tokens(inp)
        return tokens.numel() >= need and prefix.tokens.numel() >= need and torch.equal(tokens[:need],
                                                                                     prefix.tokens[:need])
    if not torch.equal(prefix.embedding, inp.embedding.reshape(-1).to(prefix.embedding)):
        return False
    tokens = _row_tokens(inp).to(prefix.tokens.device)
    if tokens.numel() < need or prefix.tokens.numel() < need or not torch.equal(tokens[:need], prefix.tokens[:need]):
        return False
    cond = torch.cat([s.cond for s in prefix.segments], dim=1)
    return torch.equal(cond, row.cond[:, :n])


def _plan_tokens(inp) -> torch.Tensor:
    t = _row_tokens(inp)
    return t.clone() if inp.host_ids is not None else t


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
            key = prompt_key(flow, inp.prompt_token, inp.prompt_feat, inp.embedding, digest=inp.prompt_digest)
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
                             key if split else None, prompt_bytes, model, _plan_tokens(inp),
                             inp.embedding.reshape(-1).to(device=row.spks.device, dtype=row.spks.dtype).clone(),
                             inp.prompt_digest if inp.host_ids is not None else None))
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


# ------------------------------------------------------------------------------------------ the cached solver

_serial = itertools.count(1)


@dataclass(eq=False)
class CachedSolve:
    """Solver state of one prefix-cached hop row between estimator calls: its new frames' noisy mel `x` [80, n]
    after `step` of `n_steps` Euler steps, the K/V its finished steps computed (hop_k / hop_v [steps, depth,
    2 (cond, uncond), n, D]) and the conv input tails at its commit points per step. `step_cached` advances any set
    of solves by one step each, whatever step each is at, so a hop can join a DiT call mid-way through another's."""
    plan: HopPlan
    x: torch.Tensor
    hop_k: torch.Tensor
    hop_v: torch.Tensor
    tails: dict
    n_steps: int
    step: int = 0
    serial: int = field(default_factory=lambda: next(_serial))

    @property
    def n(self) -> int:
        return self.x.shape[1]

    @property
    def done(self) -> bool:
        return self.step >= self.n_steps


def euler_table(flow, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(t [steps], dt [steps]) of every Euler step on the device: the recurrence of `Flow.solve` / `cfg_euler_step`
    (t += dt; dt = t_span[k + 1] - t) run once in the flow's dtype, so a row at step k uses exactly the values the
    whole solve would reach there."""
    key = (str(device), dtype)
    memo = flow.__dict__.setdefault("_cosytrt_euler", {})
    if key not in memo:
        t_span = flow.time_span(device, dtype)
        t, dt = t_span[0], t_span[1] - t_span[0]
        ts, dts = [], []
        for step in range(1, len(t_span)):
            ts.append(t)
            dts.append(dt)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        memo[key] = (torch.stack(ts), torch.stack(dts))
    return memo[key]


def start_cached(flow, plan: HopPlan) -> CachedSolve:
    """A plan's solver state before its first step: the noise columns of its new frames."""
    cfg = flow.cfg
    device, dtype = flow.rand_noise.device, flow.rand_noise.dtype
    n = plan.row.frames - plan.start
    flow._check_frames(plan.row.frames)
    S, L, D = cfg.n_timesteps, cfg.dit.depth, cfg.dit.heads * cfg.dit.dim_head
    x = flow.rand_noise[0, :, plan.start:plan.row.frames].to(device=device, dtype=dtype)
    hop_k = torch.empty(S, L, 2, n, D, device=device, dtype=dtype)
    tails = {name: [None] * S for name in ("t1", "t2", "p1", "p2")}
    return CachedSolve(plan, x, hop_k, torch.empty_like(hop_k), tails, S)


def _open_call(flow, hops, B: int, N: int, P: int, device, dtype, rows: tuple):
    call = hops.open(B, N, P, device, dtype, rows=rows)
    if call is None:  # no graph bucket holds it: the eager DiT
        call = EagerHops(flow.estimator, flow.estimator.forward_cached).open(B, N, P, device, dtype)
    return call


def step_cached(flow, solves: list, hops) -> None:
    """ONE estimator call advancing every solve by one Euler step (each at its own step: t per row). `hops`:
    `EagerHops` or `CachedHopGraphs` (a graph runner with no bucket for the call falls back to the eager DiT). Each
    row's arithmetic is the whole solve's (same noise columns, t / dt values, CFG mix and update); only the batch it
    shares the call with differs. The solves change only once the call has succeeded."""
    if not solves or any(sv.done for sv in solves):
        raise ValueError("step_cached needs solves that have steps left")
    cfg = flow.cfg
    device, dtype = flow.rand_noise.device, flow.rand_noise.dtype
    B = len(solves)
    N = max(sv.n for sv in solves)
    P = max(sv.plan.start for sv in solves)
    call = _open_call(flow, hops, B, N, P, device, dtype, tuple(sv.serial for sv in solves))
    R = call.rows
    ts, dts = euler_table(flow, device, dtype)
    if call.fresh:
        call.reset()
        for b, sv in enumerate(solves):
            p, n = sv.plan, sv.n
            call.mu[b, :, :n] = p.row.mu[:, p.start:]
            call.cond[b, :, :n] = p.row.cond[:, p.start:]
            call.mask[b, :, :n] = 1
            call.mask[R + b, :, :n] = 1
            call.spks[b] = p.row.spks
            if p.start:
                call.prefix_valid[b, :p.start] = True
                call.prefix_valid[R + b, :p.start] = True
        starts = [sv.plan.start for sv in solves] + [0] * (R - B)
        call.offsets.copy_(upload(torch.tensor(starts + starts, dtype=torch.long), call.offsets.device))
    t_rows = torch.stack([ts[sv.step] for sv in solves] + [ts[0]] * (R - B))  # on the device: no upload, no sync
    call.t.copy_(torch.cat((t_rows, t_rows)))
    for b, sv in enumerate(solves):
        call.x[b, :, :sv.n] = sv.x
        call.x[R + b, :, :sv.n] = sv.x
        if sv.plan.prefix is not None:
            if sv.plan.start:
                call.load_prefix(b, sv.step, sv.plan.prefix)
            call.load_tails(b, sv.step, sv.plan.prefix)
    v, in1, in2 = call.run()
    K1 = flow.estimator.input_embed.conv_pos_embed.kernel_size - 1
    rate = cfg.inference_cfg_rate
    v_mix = (1.0 + rate) * v[:B] - rate * v[R:R + B]  # as cfg_euler_step, elementwise
    updates = []
    for b, sv in enumerate(solves):
        s, n, p = sv.step, sv.n, sv.plan
        k, vv = call.kv_rows(b, n)
        sv.hop_k[s].copy_(k)
        sv.hop_v[s].copy_(vv)
        points = [(p.commit_to, "t1", "t2")] if p.commit_to > p.own_from else []
        if p.split:
            points.append((p.split, "p1", "p2"))
        for at, a1, a2 in points:  # in1/in2 row position m holds frame start - K1 + m
            m = at - p.start
            sv.tails[a1][s] = torch.stack((in1[b, m:m + K1], in1[R + b, m:m + K1]))
            sv.tails[a2][s] = torch.stack((in2[b, m:m + K1], in2[R + b, m:m + K1]))
        updates.append(sv.x + dts[s] * v_mix[b, :, :n])
    for sv, x in zip(solves, updates):
        sv.x = x
        sv.step += 1


def finish_cached(flow, solves: list) -> list:
    """Mel [1, 80, frames] (cached prefix mel + new frames, float32) of each finished solve, then its commits."""
    mels = []
    for sv in solves:
        if not sv.done:
            raise ValueError(f"cached hop at step {sv.step} of {sv.n_steps}: no mel yet")
        segs = sv.plan.prefix.segments if sv.plan.prefix is not None else []
        mels.append(torch.cat([s.mel for s in segs] + [sv.x], dim=1).unsqueeze(0).float())
    for sv in solves:
        _commit(flow, sv)
    return mels


def solve_cached(flow, plans: list, hops) -> list:
    """The 10 Euler steps with CFG for the planned rows' new frames only, all rows in every call (`step_cached`),
    then the commits. Returns one mel [1, 80, frames] per plan (cached prefix mel + new frames), float32. Commits
    happen only after every step succeeded; on an error the reservations are given back."""
    try:
        with torch.inference_mode():
            solves = [start_cached(flow, p) for p in plans]
            for _ in range(flow.cfg.n_timesteps):
                step_cached(flow, solves, hops)
            return finish_cached(flow, solves)
    except BaseException:
        release_plans(plans)
        raise


def _commit(flow, sv: CachedSolve) -> None:
    """Store what the solve computed and its plan commits."""
    p = sv.plan
    st, pool = p.state, p.state.pool
    if st.closed or st.prefix is not p.prefix:  # cancelled (or changed) while the hop ran
        _release_plan(p)
        return
    n = sv.n

    def segment(a: int, e: int) -> Segment:
        i, j = a - p.start, e - p.start
        whole = (i, j) == (0, n)  # the solve's own tensors; a part is copied so the rest is not kept alive
        k, v = (sv.hop_k, sv.hop_v) if whole else (sv.hop_k[:, :, :, i:j].clone(), sv.hop_v[:, :, :, i:j].clone())
        return Segment(a, k, v, sv.x[:, i:j].clone(), p.row.cond[:, a:e].clone())

    def tails(a: str, c: str):
        return torch.stack(sv.tails[a]), torch.stack(sv.tails[c])

    segs = list(p.prefix.segments) if p.prefix is not None else []
    embedding = p.embedding
    t1 = t2 = None
    if p.split:
        pt1, pt2 = tails("p1", "p2")
        entry_prefix = Prefix([segment(0, p.split)], pt1, pt2, embedding,
                              p.tokens[:_tokens_needed(flow, p.split)].clone(), p.model, p.digest)
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
        st.prefix = Prefix(segs, t1, t2, embedding, p.tokens.clone(), p.model, p.digest)


def flow_rows(flow, rows, streaming: bool, estimator=None, finalize=None, pad_to=None, hops=None) -> list:
    """`flow.inference_batch` for rows that may carry a prefix cache (FlowInput.cache): non-final streaming rows
    with an open cache compute only their new frames against it (`solve_cached`); the other rows (and cached rows
    the pool cannot serve) run the whole-history solve, batched, through `estimator`. One mel [1, 80, T_out] per
    row, each equal to the whole-history call within the flow's tolerance (tests/test_flow_cache.py). `hops`: how
    cached hops call the DiT (`CachedHopGraphs` of the backends; None: eagerly, `cached_dit_fn`)."""
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
    prepared = [flow.prepare_row(r.token, r.prompt_token, r.prompt_feat, r.embedding, f, r.ids_checked)
                for r, f in zip(rows, flags)]
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
        if hops is None:
            hops = EagerHops(flow.estimator, cached_dit_fn(flow, estimator))
        mels = solve_cached(flow, plans, hops)
        for plan, m in zip(plans, mels):
            i = cached[plan.index]
            out[i] = m[:, :, prepared[i].prompt_frames:prepared[i].frames]
    return out
