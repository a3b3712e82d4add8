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
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

from .flow_cache import (TRASH, ZERO, FlowPrefixState, Prefix, Segment, model_fingerprint, prompt_cacheable_frames,
                         prompt_key)
from .flow_hop_calls import EagerHops, StepConsts


# ------------------------------------------------------------------------------------------- estimator choice

def cached_dit_fn(flow, estimator=None):
    """The function cached hops run: the eager DiT's forward_cached, or its torch.compile'd form when the pipeline's
    estimator is compiled (CompiledDiT, or a bucketed runner whose eager fallback is one)."""
    dit = flow.estimator
    est = estimator
    while est is not None and not _is_compiled(est) and hasattr(est, "eager"):
        est = est.eager
    if est is not None and _is_compiled(est):
        return est.forward_cached  # the compiled scope's (compile_fn memoizes the whole-graph one per DiT)
    return dit.forward_cached


def _is_compiled(est) -> bool:
    return type(est).__name__ == "CompiledDiT"


# ------------------------------------------------------------------------------------------------- cached hops

@dataclass
class HopPlan:
    """One row of a cached hop: compute frames [start, row.frames) after `prefix`; then commit frames up to
    commit_to (own segment from own_from, into `own_pages` with the conv tails in `own_tail`; with split > 0 frames
    [0, split) become the prompt entry `key`, in `prompt_pages` / `prompt_tail`). Pages and tail slots are reserved
    in the pool when planned and handed over (or given back) when the hop commits (or fails)."""
    index: int
    state: FlowPrefixState
    row: object                      # flow.FlowRow
    start: int
    prefix: Optional[Prefix]
    commit_to: int
    own_from: int
    own_pages: list = field(default_factory=list)
    own_tail: Optional[int] = None
    split: int = 0
    key: Optional[str] = None
    prompt_pages: list = field(default_factory=list)
    prompt_tail: Optional[int] = None
    model: str = ""
    tokens: Optional[torch.Tensor] = None  # the row's token ids (prompt + generated; on the host with a digest)
    embedding: Optional[torch.Tensor] = None  # the row's speaker embedding [192]
    digest: Optional[str] = None           # the row's prompt_digest, when the caller gave one

    def out_pages(self, chunk: int) -> list:
        """The page each chunk of the new frames is written to: reserved pages for committed chunks, else the
        sink."""
        out = []
        for a in range(self.start, self.row.frames, chunk):
            if a < self.split:
                out.append(self.prompt_pages[a // chunk])
            elif self.own_from <= a < self.commit_to and self.own_tail is not None:
                out.append(self.own_pages[(a - self.own_from) // chunk])
            else:
                out.append(TRASH)
        return out


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
    the pages and tail slots of its commits in the pool. Returns (plans, whole): `whole` are indices that run the
    whole-history call instead."""
    chunk = flow.cfg.dit.static_chunk_size
    model = model_fingerprint(flow)
    plans, whole = [], []
    for k, (inp, row) in enumerate(zip(inputs, rows)):
        st: FlowPrefixState = inp.cache
        pool = st.pool
        pool.storage(flow)
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
        split, prompt_pages, prompt_tail = 0, [], None
        if key is not None and start == 0:
            split = prompt_cacheable_frames(flow, int(inp.prompt_token.numel()))
            got = pool.reserve(split // chunk, 1) if 0 < split <= commit_to else None
            if got is None:
                split = 0
            else:
                prompt_pages, (prompt_tail,) = got
        own_from = max(start, split)
        own_pages, own_tail = [], None
        if not inp.commit and commit_to > own_from > 0:  # the last hop: no later hop reads them
            commit_to = own_from
            pool.count(uncommitted_last_hops=1)
        if commit_to > own_from:
            got = pool.reserve((commit_to - own_from) // chunk, 1)
            if got is None:
                pool.count(fallback_hops=1)
                commit_to = max(start, split)
                if commit_to == 0:  # nothing cached, nothing to commit: today's whole-history hop
                    whole.append(k)
                    pool.count(whole_hops=1, frames_computed=row.frames)
                    continue
            else:
                own_pages, (own_tail,) = got
        else:
            commit_to = max(commit_to, start)
        plans.append(HopPlan(k, st, row, start, st.prefix, commit_to, own_from, own_pages, own_tail, split,
                             key if split else None, prompt_pages, prompt_tail, model, _plan_tokens(inp),
                             inp.embedding.reshape(-1).to(device=row.spks.device, dtype=row.spks.dtype).clone(),
                             inp.prompt_digest if inp.host_ids is not None else None))
        pool.count(cached_hops=1, frames_computed=row.frames - start, frames_reused=start)
    return plans, whole


def _release_plan(p: HopPlan) -> None:
    tails = [t for t in (p.own_tail, p.prompt_tail) if t is not None]
    if p.own_pages or p.prompt_pages or tails:
        p.state.pool.release(p.own_pages + p.prompt_pages, tails)
    p.own_pages, p.prompt_pages, p.own_tail, p.prompt_tail = [], [], None, None


def release_plans(plans: list) -> None:
    """Give back the pool reservations of plans that will not run (the call failed)."""
    for p in plans:
        _release_plan(p)


# ------------------------------------------------------------------------------------------ the cached solver

_serial = itertools.count(1)


@dataclass(eq=False)
class CachedSolve:
    """Solver state of one prefix-cached hop row between estimator calls: its slot in a `SolveArena` (noisy mel x
    of its n new frames after `step` of `n_steps` Euler steps, mu, cond, speaker row) and its step table (`head`,
    the prefix page table, the new frames' pages). Its K/V and conv tails go to the plan's reserved pages and tail
    slots step by step. `step_cached` advances any set of solves by one step each, whatever step each is at, so a
    hop can join a DiT call mid-way through another's."""
    plan: HopPlan
    arena: object          # flow_hop_calls.SolveArena
    slot: int
    n: int
    head: list
    prefix_pages: list
    out_pages: list
    n_steps: int
    step: int = 0
    serial: int = field(default_factory=lambda: next(_serial))

    @property
    def done(self) -> bool:
        return self.step >= self.n_steps

    def row(self) -> tuple:
        """This step's table row (head with the current step, prefix pages, new-frame pages)."""
        self.head[1] = self.step
        return self.head, self.prefix_pages, self.out_pages

    def release(self) -> None:
        """Give back the arena slot (once) and the plan's reservations (a solve that will not finish)."""
        if self.slot:
            self.arena.give(self.slot)
            self.slot = 0
        _release_plan(self.plan)


def step_consts(flow, device, dtype) -> StepConsts:
    """The `StepConsts` of this flow on `device` / `dtype` (one object per flow and place: graphs keep it). The Euler
    table is the recurrence of `Flow.solve` / `cfg_euler_step` (t += dt; dt = t_span[k + 1] - t) run once in the
    flow's dtype, so a row at step k uses exactly the values the whole solve would reach there."""
    key = (str(device), dtype)
    memo = flow.__dict__.setdefault("_cosytrt_step_consts", {})
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
        memo[key] = StepConsts(torch.stack(ts), torch.stack(dts), flow.cfg.inference_cfg_rate)
    return memo[key]


def hop_runner(flow, hops=None, fn=None):
    """`hops` (CachedHopGraphs of the backends, or EagerHops), else eager hops through `fn` (default the eager
    forward_cached), one per function and thread kept on the flow (their arena outlives the call; a growable arena
    is not safe to share between threads, so two threads running cached hops of one flow never share one)."""
    if hops is not None:
        return hops
    fn = fn or flow.estimator.forward_cached
    local = flow.__dict__.get("_cosytrt_eager_hops")
    if local is None:
        local = flow.__dict__.setdefault("_cosytrt_eager_hops", threading.local())
    runners = local.__dict__.setdefault("runners", [])
    for r in runners:  # `==`: a bound method is a new object at every attribute access
        if r.fn == fn:
            return r
    runners.append(EagerHops(flow.estimator, fn))
    return runners[-1]


def start_cached(flow, plan: HopPlan, hops=None) -> CachedSolve:
    """A plan's solver state before its first step: the noise columns of its new frames and its fixed inputs in a
    slot of `hops`' arena (see `hop_runner`)."""
    cfg = flow.cfg
    device, dtype = flow.rand_noise.device, flow.rand_noise.dtype
    row, start = plan.row, plan.start
    n = row.frames - start
    flow._check_frames(row.frames)
    chunk = cfg.dit.static_chunk_size
    arena, slot = hop_runner(flow, hops).take(n, device, dtype)
    try:
        arena.load(slot, flow.rand_noise[0, :, start:row.frames].to(device=device, dtype=dtype),
                   row.mu[:, start:], row.cond[:, start:], row.spks)
    except BaseException:
        arena.give(slot)
        raise
    prefix = plan.prefix
    tail_in = prefix.tail if prefix is not None else ZERO
    head = [slot, 0, start, n, tail_in,
            TRASH if plan.own_tail is None else plan.own_tail, 0 if plan.own_tail is None else plan.commit_to - start,
            TRASH if plan.prompt_tail is None else plan.prompt_tail, plan.split - start if plan.split else 0]
    return CachedSolve(plan, arena, slot, n, head, list(prefix.pages) if prefix is not None else [],
                       plan.out_pages(chunk), cfg.n_timesteps)


def step_cached(flow, solves: list, hops=None) -> None:
    """ONE estimator call per arena advancing every solve by one Euler step (each at its own step: t per row).
    `hops`: `EagerHops` or `CachedHopGraphs` (solves in its arena run in a graph bucket when one holds the call,
    else eagerly). Each row's arithmetic is the whole solve's (same noise columns, t / dt values, CFG mix and
    update); only the batch it shares the call with differs. A solve's step counter moves once its call was
    launched."""
    if not solves or any(sv.done for sv in solves):
        raise ValueError("step_cached needs solves that have steps left")
    runner = hop_runner(flow, hops)
    store = solves[0].plan.state.pool.store
    consts = step_consts(flow, flow.rand_noise.device, flow.rand_noise.dtype)
    groups: dict = {}
    for sv in solves:
        groups.setdefault(id(sv.arena), []).append(sv)
    for group in groups.values():
        N = max(sv.n for sv in group)
        P = max(sv.plan.start for sv in group)
        runner.run(store, group[0].arena, [sv.row() for sv in group], N, P, consts)
        for sv in group:
            sv.step += 1


def finish_cached(flow, solves: list) -> list:
    """Mel [1, 80, frames] (cached prefix mel + new frames, float32) of each finished solve, then its commits."""
    mels = []
    for sv in solves:
        if not sv.done:
            raise ValueError(f"cached hop at step {sv.step} of {sv.n_steps}: no mel yet")
        segs = sv.plan.prefix.segments if sv.plan.prefix is not None else []
        mels.append(torch.cat([s.mel for s in segs] + [sv.arena.x[sv.slot, :, :sv.n]], dim=1).unsqueeze(0).float())
    for sv in solves:
        _commit(flow, sv)
        sv.release()
    return mels


def solve_cached(flow, plans: list, hops=None) -> list:
    """The 10 Euler steps with CFG for the planned rows' new frames only, all rows in every call (`step_cached`),
    then the commits. Returns one mel [1, 80, frames] per plan (cached prefix mel + new frames), float32. Commits
    happen only after every step succeeded; on an error the reservations are given back."""
    solves = []
    try:
        with torch.inference_mode():
            for p in plans:
                solves.append(start_cached(flow, p, hops))
            for _ in range(flow.cfg.n_timesteps):
                step_cached(flow, solves, hops)
            return finish_cached(flow, solves)
    except BaseException:
        for sv in solves:
            sv.release()
        release_plans(plans)
        raise


def _commit(flow, sv: CachedSolve) -> None:
    """Hand what the solve computed and its plan commits to the request's prefix (and the prompt entry)."""
    p = sv.plan
    st, pool = p.state, p.state.pool
    if st.closed or st.prefix is not p.prefix:  # cancelled (or changed) while the hop ran
        _release_plan(p)
        return
    x = sv.arena.x[sv.slot]

    def segment(a: int, e: int) -> Segment:
        return Segment(a, x[:, a - p.start:e - p.start].clone(), p.row.cond[:, a:e].clone())

    segs = list(p.prefix.segments) if p.prefix is not None else []
    pages = list(p.prefix.pages) if p.prefix is not None else []
    tail = None
    embedding = p.embedding
    if p.split:
        entry_prefix = Prefix([segment(0, p.split)], list(p.prompt_pages), p.prompt_tail, embedding,
                              p.tokens[:_tokens_needed(flow, p.split)].clone(), p.model, p.digest)
        entry = pool.prompt_register(p.key, entry_prefix)
        if entry is not None:
            st.use_entry(entry)
        else:  # another request registered this prompt meanwhile: keep our own copy of the frames we computed
            st.own(p.prompt_pages, [p.prompt_tail])
        segs, pages, tail = list(entry_prefix.segments), list(entry_prefix.pages), p.prompt_tail
        p.prompt_pages, p.prompt_tail = [], None
    if p.commit_to > p.own_from and p.own_tail is not None:
        segs.append(segment(p.own_from, p.commit_to))
        pages += p.own_pages
        st.own(p.own_pages, [p.own_tail])
        if p.prefix is not None:
            st.disown_tail(p.prefix.tail)  # replaced by this hop's (an entry's tail is not the request's own)
        tail = p.own_tail
        p.own_pages, p.own_tail = [], None
    if tail is not None:
        st.prefix = Prefix(segs, pages, tail, embedding, p.tokens.clone(), p.model, p.digest)


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
            hops = hop_runner(flow, None, cached_dit_fn(flow, estimator))
        mels = solve_cached(flow, plans, hops)
        for plan, m in zip(plans, mels):
            i = cached[plan.index]
            out[i] = m[:, :, prepared[i].prompt_frames:prepared[i].frames]
    return out
