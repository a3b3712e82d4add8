"""Multi-step AR decode (`SchedulerConfig.ar_decode_steps`): K decode steps per runner call, sampled on the device,
each step's ids fed back as the next step's tokens and shifted into the RAS window there. Every test here checks the
one promise: the tokens are exactly the ones single steps give (each row's own uniforms in the same order, the stop
modes of each step, the window the host's history would give, rows stopping or reaching their limit mid-call), and
where multi-step cannot run the rows take single steps with nothing drawn twice."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosytrt.runtime.models.sampling import (SamplingParams, StaticSampler, TokenPolicy, pack_rows,
                                             select_packed)
from cosytrt.runtime.scheduling.ar_worker import ARWorker
from cosytrt.runtime.scheduling.config import SchedulerConfig
from cosytrt.runtime.scheduling.stage_clock import StageClock
from cosytrt.runtime.stages import ar_graphs
from cosytrt.runtime.stages.ar_graphs import DecodeGraphs, decode_steps
from graph_stand_in import DirectCall, prefilled_rows

V, STOP = 6761, 6561


def _policy(seed: int, **kw) -> TokenPolicy:
    extra = {k: kw.pop(k) for k in ("mask_all_stops_before_min",) if k in kw}
    return TokenPolicy(4, SamplingParams(seed=seed, **kw), **extra)


def _draws(p: TokenPolicy, n: int) -> list[float]:
    return [u for _ in range(n) for u in p.draw()]


# ---------------------------------------------------------------- packing

def test_pack_rows_steps_draw_and_mask_as_single_steps():
    """`pack_rows(steps=3)`: step k's block holds each row's next two uniforms (the ones the k-th single step would
    draw) and its stop mode k steps ahead (here crossing min_len inside the call); `undraw` gives them all back."""
    pols = [_policy(1, min_tokens=2), _policy(2, min_tokens=1, mask_all_stops_before_min=True), _policy(3)]
    for p in pols:
        p.history = [5]
    ref = copy.deepcopy(pols)
    packed = pack_rows(pols, V, steps=3)
    assert packed.steps == 3 and packed.rows == 3
    c = 7 + packed.width
    blocks = [[packed.flat[(k * 3 + i) * c:(k * 3 + i + 1) * c] for i in range(3)] for k in range(3)]
    for k in range(3):
        for i, p in enumerate(ref):
            assert blocks[k][i][:2] == p.draw(), (k, i)
            assert blocks[k][i][6] == p.stop_mask_mode(k)
            assert blocks[k][i][7:] == blocks[0][i][7:]     # the window columns repeat the first step's
    assert [b[0][6] for b in blocks] == [1, 0, 0] and [b[1][6] for b in blocks] == [0, 0, 0]
    assert packed.modes == {0, 1}
    # the single-step layout is unchanged
    one = pack_rows(copy.deepcopy(ref), V)
    assert one.steps == 1 and len(one.flat) == 3 * c
    # undraw: the next draws are the given-back uniforms again, then the stream goes on as single steps' would
    packed.undraw(pols)
    fresh = _policy(1, min_tokens=2)
    expected = _draws(fresh, 4)
    assert expected[:6] == [u for k in range(3) for u in blocks[k][0][:2]]
    assert _draws(pols[0], 4) == expected


@pytest.mark.parametrize("drawn, given_back", [(3, 2), (33, 3), (32, 1)])
def test_undraw_puts_the_uniforms_back_in_order(drawn, given_back):
    """Given back (the last steps drawn, also across the 32-step draw blocks), the uniforms come again in order and
    the stream then goes on where it was: as if they had never been drawn."""
    p, q = _policy(7), _policy(7)
    got = _draws(p, drawn)
    keep = 2 * (drawn - given_back)
    p.undraw(got[keep:])
    assert got[:keep] + _draws(p, given_back + 40) == _draws(q, drawn + 40)


def test_static_sampler_fits_steps_checks_before_drawing():
    s = StaticSampler(V, STOP)
    assert s.fits_steps([_policy(0), _policy(1, greedy=True, top_p=0.5)])
    assert not s.fits_steps([_policy(0), _policy(1, win_size=5)])       # another RAS window
    assert not s.fits_steps([_policy(0, top_k=5)])                       # the batch's top_k is not the sampler's
    assert not s.fits_steps([])
    assert s.holds(_policy(0, top_k=5)) and not s.holds(_policy(0, top_k=50)) and not s.holds(_policy(0, win_size=5))
    assert s.example_rows(4, steps=3).shape == (3, 4, 7 + s.width)


# ---------------------------------------------------------------- the device function and the graphs

@pytest.fixture
def lm(golden_lm, monkeypatch):
    monkeypatch.setattr(ar_graphs, "GraphCache", DirectCall)
    golden_lm.setup_cache(5, 257)  # 4 slots + the scratch slot 4
    return golden_lm


def _single_steps(dg: DecodeGraphs, policies, tokens, slots, pos, n):
    """n single steps through `run_sampled` + `accept`: every step's ids."""
    out = []
    for _ in range(n):
        packed = pack_rows(policies, V)
        _, ids = dg.run_sampled(tokens, slots, pos, max(pos) + 1, packed)
        out.append(ids)
        for p, t in zip(policies, ids):
            p.accept(t)
        tokens, pos = ids, [x + 1 for x in pos]
    return out


def test_decode_graphs_steps_equal_single_steps(lm):
    """`DecodeGraphs(steps=4)` (the CUDA graph replaced by a direct call of the captured function): a call's four
    steps are exactly four single sampled steps' ids — the real LM, its own ids fed back, RAS repeats resampled from
    the window the device keeps (repeat_min 1: any id in the window), a greedy row, a stop mode that changes
    mid-call, three rows in the 4-row bucket — and the K/V it wrote let the next call go on as single steps would."""
    cfg = lm.config
    sampler = StaticSampler(cfg.speech_vocab, cfg.speech_token_size)
    single = DecodeGraphs(lm.decode, [2, 4], [64, 128], 4, "cpu", sampler)
    multi = DecodeGraphs(lm.decode, [2, 4], [64, 128], 4, "cpu", sampler, steps=4)
    assert multi.graphs[128].shapes[4][3] == (4, 4, 7 + sampler.width)
    def setup():
        for layer in lm.backbone.layers:
            kv = layer.self_attn.kv_cache
            kv.k.copy_(torch.randn(kv.k.shape, generator=torch.Generator().manual_seed(1)))
            kv.v.copy_(torch.randn(kv.v.shape, generator=torch.Generator().manual_seed(2)))
        pols = [_policy(s, greedy=s == 2, min_tokens=2 + s, max_tokens=100) for s in range(3)]
        for p in pols:
            p.history = [7, 3, 7][:1 + len(p.history)]
        return pols

    with torch.inference_mode():
        ref_pols = setup()
        ref = _single_steps(single, ref_pols, [5, 9, 11], [0, 1, 2], [3, 60, 8], 8)
        pols = setup()
        got, tokens, pos = [], [5, 9, 11], [3, 60, 8]
        for _ in range(2):
            packed = pack_rows(pols, V, steps=4)
            ids = multi.run_steps(tokens, [0, 1, 2], pos, max(pos) + 4, packed)
            assert len(ids) == 4 and all(len(x) == 3 for x in ids)
            for step in ids:
                for p, t in zip(pols, step):
                    p.accept(t)
            got += ids
            tokens, pos = ids[-1], [x + 4 for x in pos]
    assert got == ref
    assert [p.history for p in pols] == [p.history for p in ref_pols]
    assert multi.replays == 2 and multi.sampled == 8
    assert multi.fits(4, 128) and not multi.fits(5, 10)


def test_runner_keeps_its_multi_step_graphs_per_steps(golden_lm, monkeypatch):
    """`TorchARRunner.enable_decode_steps`: a `steps` asked for again (a later scheduler, a benchmark's A/B) gets the
    graphs captured the first time, off (1) keeps them; the graph path's ids are the eager path's. (The ladder's
    shape is set by hand: on the CPU the runner makes no graphs.)"""
    from cosytrt.runtime.stages.ar_runner import PrefillRow, TorchARRunner

    monkeypatch.setattr(ar_graphs, "GraphCache", DirectCall)
    cfg = golden_lm.config
    lm = copy.deepcopy(golden_lm)
    runner = TorchARRunner(lm, 4, 256, "cpu", cuda_graphs=False)
    runner.enable_decode_steps(3)
    assert runner.step_graphs is None and runner.decode_steps_n == 3   # no ladder on the CPU: eager
    slot = runner.allocate()
    with torch.inference_mode():
        runner.prefill([PrefillRow(slot, torch.randn(6, cfg.qwen.hidden_size,
                                                     generator=torch.Generator().manual_seed(0)))])
    pol = _policy(3, min_tokens=1)
    eager_pol = copy.deepcopy(pol)
    with torch.inference_mode():
        eager = runner.decode_steps([1], [slot], [6], pack_rows([eager_pol], cfg.speech_vocab, steps=3))
    runner._decode_graph_shape = ([1, 2], [64, 256])
    runner.slots._free.remove(3)           # a scratch slot for the padding rows, as a runner with graphs has
    runner.slots.scratch_slot = 3
    runner.enable_decode_steps(3)
    first = runner.step_graphs
    assert first is not None and first.steps == 3 and runner.can_decode_steps(2, 62) \
        and not runner.can_decode_steps(2, 255) and not runner.can_decode_steps(3, 10)
    with torch.inference_mode():
        graphed = runner.decode_steps([1], [slot], [6], pack_rows([pol], cfg.speech_vocab, steps=3))
    assert graphed == eager and first.replays == 1
    runner.enable_decode_steps(1)
    assert runner.step_graphs is None and runner.decode_steps_n == 1 and not runner.can_decode_steps(1, 10)
    runner.enable_decode_steps(3)
    assert runner.step_graphs is first
    runner.enable_decode_steps(2)
    assert runner.step_graphs is not first and runner.step_graphs.steps == 2
    assert runner.stats()["multi_step_graph_replays"] == 0
    runner.close()
    assert runner.step_graphs is None


def test_decode_steps_needs_a_sampler():
    with pytest.raises(ValueError, match="sampler"):
        DecodeGraphs(lambda *a, **k: None, [2], [64], 4, "cpu", None, steps=2)


# ---------------------------------------------------------------- the AR worker

class StepRunner:
    """Logits fixed per slot; `decode_steps` runs `ar_graphs.decode_steps` over them (as `TorchARRunner` does
    eagerly on the CPU). `fail_next`: the next multi-step call raises; `max_len`: KV positions per slot."""

    def __init__(self, slots: int, steps: int, stop_slots=()):
        self.max_batch, self.max_len = slots, 1 << 20
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(slots, V, generator=g) * 2
        self.table[:, STOP:] = float("-inf")
        for s in (x for x in stop_slots if x < slots):  # these rows meet stop id 6562 often once allowed
            self.table[s, STOP + 1] = 7.0
        self.free = list(range(slots - 1, -1, -1))
        self.decode_steps_n = steps
        self.step_sampler = StaticSampler(V, STOP) if steps > 1 else None
        self.fail_next = False
        self.calls = 0

    def allocate(self):
        return self.free.pop()

    def release(self, slot):
        self.free.append(slot)

    def decode(self, tokens, slots, positions):
        return self.table[slots]

    def can_decode_steps(self, rows, need_kv):
        return need_kv + self.decode_steps_n - 1 <= self.max_len

    def decode_steps(self, tokens, slots, positions, packed):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected multi-step failure")
        self.calls += 1
        s = torch.tensor(slots)
        rows = self.step_sampler.rows(packed, len(slots))
        return decode_steps(lambda t, s_, p: self.table[s_], self.step_sampler, torch.tensor(tokens), s,
                            torch.tensor(positions), rows).tolist()


class Sink:
    def __init__(self):
        self.calls = []

    def tokens(self, r, done):
        self.calls.append((id(r), len(r.tokens), done))

    def flush(self):
        pass


ROWS = [dict(min_tokens=3, max_tokens=40), dict(min_tokens=6, max_tokens=22, mask_all_stops_before_min=True),
        dict(greedy=True, min_tokens=1, max_tokens=9), dict(min_tokens=2, max_tokens=50, top_p=0.6),
        dict(min_tokens=0, max_tokens=31)]


def _run(steps: int, rows=ROWS, setup=None):
    runner, sink, failed = StepRunner(len(rows), steps, stop_slots=(0, 3)), Sink(), []
    w = ARWorker(runner, SchedulerConfig(ar_decode_steps=max(steps, 1)), sink,
                 lambda r, e: failed.append((r, str(e))), StageClock(False), "cpu")
    reqs = []
    for i, kw in enumerate(rows):
        pol = _policy(i, **kw)
        pol.next_input = 0
        r = SimpleNamespace(policy=pol, slot=runner.allocate(), pos=10, tokens=[],
                            metrics=SimpleNamespace(t_ar=0.0), dead=False)
        w.running.append(r)
        reqs.append(r)
    if setup:
        setup(w, runner)
    with torch.inference_mode():
        for _ in range(200):
            if not w.running:
                break
            w._decode()
    assert not failed and not w.running
    return reqs, w, runner, sink


@pytest.mark.parametrize("steps", [2, 4, 7])
def test_worker_multi_step_gives_the_single_step_tokens(steps):
    """Rows stopping mid-call (stop id 6562 once allowed, rows 0 and 3), reaching max_tokens mid-call, a greedy row, a
    stop mode switching mid-call, another top_p: every row's tokens, history and emitted order equal single steps',
    and the sink sees the same (row, tokens so far, done) sequence per row."""
    ref, w1, _, sink1 = _run(1)
    got, wk, runner, sink = _run(steps)
    assert runner.calls > 0 and wk.counters.multi_step_calls == runner.calls
    for a, b in zip(ref, got):
        assert b.tokens == a.tokens and b.policy.history == a.policy.history and b.slot is None
    assert any(len(r.policy.history) < r.policy.max_len for r in ref)      # some stopped on a stop id ...
    assert any(len(r.policy.history) == r.policy.max_len for r in ref)     # ... and some at their limit
    per_row = lambda calls, reqs: [[c[1:] for c in calls if c[0] == id(r)] for r in reqs]  # noqa: E731
    assert per_row(sink.calls, got) == per_row(sink1.calls, ref)
    assert wk.counters.decode_rows == w1.counters.decode_rows and wk.counters.decode_steps == w1.counters.decode_steps


def test_worker_multi_step_falls_back_without_drawing_twice():
    """Rows the device sampler does not hold (another RAS window, a top_k above its 25) take single steps — as many
    per iteration as the others' call makes, so they keep pace — while the others go on in multi-step calls, every
    row with the tokens single steps give it (nothing drawn ahead for them); when no row of the batch fits, every
    step is single. A failing multi-step call gives its uniforms back and the rows go on in single steps with the
    tokens they would have got; rows too close to the slot's end take single steps."""
    rows = ROWS[:2] + [dict(min_tokens=2, max_tokens=60, win_size=5), dict(min_tokens=2, max_tokens=45, top_k=50)]
    ref, w1, _, _ = _run(1, rows)
    got, w, runner, _ = _run(4, rows)
    assert runner.calls > 0 and w.counters.multi_step_calls == runner.calls
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert w.counters.decode_rows == w1.counters.decode_rows      # every row sampled as often as in single steps
    odd = [dict(min_tokens=2, max_tokens=30, win_size=5), dict(min_tokens=2, max_tokens=30, top_k=50)]
    ref, _, _, _ = _run(1, odd)
    got, w, runner, _ = _run(4, odd)
    assert runner.calls == 0 and [r.tokens for r in got] == [r.tokens for r in ref]

    ref, _, _, _ = _run(1)
    got, w, runner, _ = _run(4, setup=lambda w, runner: setattr(runner, "fail_next", True))
    assert [r.tokens for r in got] == [r.tokens for r in ref] and runner.calls > 0

    def near_the_end(w, runner):
        runner.max_len = 10 + 12     # the slots end 12 positions after the rows' start
    got, w, runner, _ = _run(4, [dict(min_tokens=0, max_tokens=30)], setup=near_the_end)
    ref, _, _, _ = _run(1, [dict(min_tokens=0, max_tokens=30)])
    assert got[0].tokens == ref[0].tokens
    assert runner.calls <= 3   # calls while the 4 steps fit; single steps after


# ---------------------------------------------------------------- the scheduler, the real tiny model (CPU)

def test_scheduler_decode_steps_keep_tokens_and_audio(one_torch_thread, tiny_tts):
    """`SchedulerConfig(ar_decode_steps=4)` through the real `TorchARRunner` (eagerly on the CPU) and the whole
    scheduler: free-running requests (stop ids, RAS repeats, a greedy one), streamed and offline, get the same tokens
    and audio as single steps; a request with another top_k makes its batch take single steps, with its own tokens
    the same too."""
    from cosytrt.runtime.stages.request import default_voice_wav
    from cosytrt.runtime.tts import make_request
    from test_scheduler_features import run_staggered

    tts = tiny_tts
    speaker = tts.make_speaker(default_voice_wav(16000, 1.0), "Short voice.", 16000)
    reqs = [make_request("Sample me freely, please.", speaker=speaker, seed=s, max_tokens=90, stream=s % 2 == 0,
                         **extra) for s, extra in enumerate([{}, {}, {"greedy": True}, {}, {"top_k": 5}])]

    def run(cfg):
        return run_staggered(tts, cfg, reqs, gap_s=0.0)

    on, tok_on, st = run(SchedulerConfig(ar_decode_steps=4))
    assert st["ar"]["multi_step_calls"] > 0 and st["completed"] == 5
    assert st["host_s"]["ar"]["wall_s"] > 0 and st["host_s"]["ar"]["cpu_s"] > 0   # the AR thread's host seconds
    off, tok_off, st_off = run(SchedulerConfig())
    assert st_off["ar"]["multi_step_calls"] == 0
    assert tok_on == tok_off and len({len(t) for t in tok_on}) > 1
    for a, b in zip(on, off):
        assert a.shape == b.shape and np.abs(a - b).max() <= 2e-3   # the batching bound (other DiT batches)


def test_reconfigure_switches_decode_steps_over_the_same_runner(one_torch_thread, tiny_tts):
    """`TTS.reconfigure(ar_decode_steps=4)` keeps the AR runner (no new runner, its multi-step state set by the new
    scheduler) and the request's tokens; switching back leaves no multi-step call."""
    from dataclasses import replace

    from cosytrt.runtime.tts import make_request

    tts = tiny_tts
    base = tts.scheduler_config
    req = dict(seed=11, max_tokens=70)
    try:
        h = tts.submit(make_request("Four at a time, or one.", **req))
        h.result(timeout=120)
        runner = tts.ar_runner
        tts.reconfigure(replace(base, ar_decode_steps=4))
        h4 = tts.submit(make_request("Four at a time, or one.", **req))
        h4.result(timeout=120)
        assert tts.ar_runner is runner and runner.decode_steps_n == 4 and h4.tokens == h.tokens
        assert tts.scheduler.stats()["ar"]["multi_step_calls"] > 0
        tts.reconfigure(replace(base, ar_decode_steps=1))
        st = tts.scheduler.stats()   # (the new scheduler starts on first use)
        assert runner.decode_steps_n == 1 and st["ar"]["multi_step_calls"] == 0
    finally:
        tts.reconfigure(base)


def test_ar_decode_steps_must_be_a_positive_int():
    from cosytrt.engines.errors import InputError

    for bad in (0, -1, 2.0, True, 33):
        with pytest.raises(InputError, match="ar_decode_steps"):
            SchedulerConfig(ar_decode_steps=bad)
    assert SchedulerConfig(ar_decode_steps=32).ar_decode_steps == 32


# ---------------------------------------------------------------- on a GPU: the captured multi-step graphs

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: the graph capture itself needs a GPU")
def test_multi_step_graphs_on_cuda_equal_single_steps(golden_lm):
    """On a GPU: `TorchARRunner.enable_decode_steps(4)` captures multi-step decode graphs; five rows (bucket 8,
    padding rows) decoded 4 steps per replay give exactly the token streams of single sampled steps."""
    from cosytrt.runtime.stages.ar_runner import TorchARRunner

    cfg = golden_lm.config
    streams = {}
    for steps in (1, 4):
        lm = copy.deepcopy(golden_lm).to("cuda")
        runner = TorchARRunner(lm, 8, 512, "cuda", graph_sampling=True, graph_batches=(1, 4, 8))
        runner.enable_decode_steps(steps)
        policies, slots, pos = prefilled_rows(runner, cfg)
        with torch.inference_mode():
            for _ in range(40 // steps):
                live = [i for i in range(5) if not policies[i].finished]
                args = ([policies[i].next_input for i in live], [slots[i] for i in live], [pos[i] for i in live])
                if steps == 1:
                    packed = pack_rows([policies[i] for i in live], cfg.speech_vocab)
                    logits, ids = runner.decode_sampled(*args, packed)
                    assert ids == select_packed(logits.clone(), packed)
                    ids = [ids]
                else:
                    assert runner.can_decode_steps(len(live), max(args[2]) + 1)
                    ids = runner.decode_steps(*args, pack_rows([policies[i] for i in live], cfg.speech_vocab,
                                                               steps=steps))
                for step in ids:
                    for i, tok in zip(live, step):
                        if not policies[i].finished:
                            policies[i].accept(tok)
                            pos[i] += 1
        streams[steps] = [p.history for p in policies]
        if steps > 1:
            assert runner.stats()["multi_step_graph_replays"] == 10
        runner.close()
    assert streams[4] == streams[1]
