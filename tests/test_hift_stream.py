"""O(chunk) HiFT streaming: the pushed samples equal upstream's quadratic loop (HiFT re-run on the whole mel so far,
samples past those already sent), the work per push is bounded, and several streams advance together."""
import copy
import os

import pytest
import torch
from safetensors.torch import load_file

from cosytrt.runtime.models.config import config_from_golden_json
from cosytrt.engines.errors import InputError, RequestTooLongError
from cosytrt.runtime.models.hift import load_hift
from cosytrt.runtime.models.hift_stream import HiFTStream, push_batch

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
TOTAL = 230


@pytest.fixture(scope="module")
def hift():
    cfg = config_from_golden_json(os.path.join(GOLDEN, "config.json")).hift
    return load_hift(cfg, os.path.join(GOLDEN, "hift.pt"))  # default noise: 3000 frames


@pytest.fixture(scope="module")
def mel():
    base = load_file(os.path.join(GOLDEN, "vectors.safetensors"))["hift.mel"]
    g = torch.Generator().manual_seed(7)
    m = torch.cat([base, base.flip(2)] * 2, dim=2)[:, :, :TOTAL]
    return m + 0.3 * torch.randn(m.shape, generator=g)


def upstream_loop(hift, mel, schedule):
    """What upstream yields per chunk: HiFT on all mel so far (final chunk: finalize), minus the samples sent."""
    out, sent, n = [], 0, 0
    for k, c in enumerate(schedule):
        n += c
        final = k == len(schedule) - 1
        if final or n >= hift.held_back_frames:
            wav = hift.inference(mel[:, :, :n], finalize=final)[0]
        else:
            wav = mel.new_zeros(1, 0)
        out.append(wav[:, sent:])
        sent = max(sent, wav.shape[1])
    return out


def stream(hift, mel, schedule, check_work=True):
    s, n, out = HiFTStream(hift), 0, []
    for k, c in enumerate(schedule):
        out.append(s.push(mel[:, :, n:n + c], finalize=k == len(schedule) - 1))
        n += c
        if check_work:  # constant context + the chunk, never the history
            assert s.last_decode_window_frames <= s.context_frames + c + hift.held_back_frames
            assert s.last_f0_window_frames <= hift.f0_left_context + c + hift.f0_look_right
            assert s.history_frames <= s.context_frames + hift.held_back_frames + hift.f0_left_context
    return out


def _sched(*head):
    return list(head) + [TOTAL - sum(head)]


SCHEDULES = {
    "54-100-rest": _sched(54, 100),
    "50s": _sched(50, 50, 50, 50),
    "tiny-first": _sched(5, 0, 4, 1, 60, 7),
    "hops-25-50-100": _sched(28, 50, 100),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_stream_equals_upstream_prefix_recompute(hift, mel, name):
    schedule = SCHEDULES[name]
    ref = upstream_loop(hift, mel, schedule)
    got = stream(hift, mel, schedule)
    assert [g.shape[1] for g in got] == [r.shape[1] for r in ref]
    assert sum(g.shape[1] for g in got) == TOTAL * 480
    err = max((g - r).abs().max().item() for g, r in zip(got, ref) if r.numel())
    assert err <= 2e-3
    assert err <= 2e-5, err  # measured <= 6e-7: the window reproduces the prefix run up to float rounding


def test_work_per_push_does_not_grow_with_history(hift, mel):
    s = HiFTStream(hift)
    windows = []
    for i in range(0, TOTAL - 10, 10):
        s.push(mel[:, :, i:i + 10])
        windows.append(s.last_decode_window_frames)
    # context + chunk + (8 - 3) held back, rounded up to the window step with spare history
    from cosytrt.runtime.models.hift_stream import WINDOW_STEP

    need = s.min_context + 10 + 5
    assert max(windows[5:]) == min(windows[5:]) == -(-need // WINDOW_STEP) * WINDOW_STEP
    assert s.mel_start > 0 and s.history_frames < 60 + WINDOW_STEP


def test_context_is_needed(hift, mel):
    """With too little left context the window's zero padding shows: the receptive field is real."""
    schedule = SCHEDULES["50s"]
    ref = torch.cat(upstream_loop(hift, mel, schedule), dim=1)
    s, n, out = HiFTStream(hift, context_frames=4), 0, []
    for k, c in enumerate(schedule):
        out.append(s.push(mel[:, :, n:n + c], finalize=k == len(schedule) - 1))
        n += c
    assert (torch.cat(out, dim=1) - ref).abs().max().item() > 1e-3
    assert hift.decode_left_context() == 30


def test_push_batch_advances_streams_together(hift, mel):
    schedules = [SCHEDULES["50s"], SCHEDULES["54-100-rest"], _sched(50, 50, 50, 50)]
    mels = [mel, mel.flip(2), mel * 0.9]
    refs = [upstream_loop(hift, m, sc) for m, sc in zip(mels, schedules)]
    streams = [HiFTStream(hift) for _ in schedules]
    got = [[] for _ in schedules]
    pos = [0] * len(schedules)
    for step in range(max(len(sc) for sc in schedules)):
        idx = [i for i, sc in enumerate(schedules) if step < len(sc)]
        chunks = [mels[i][:, :, pos[i]:pos[i] + schedules[i][step]] for i in idx]
        flags = [step == len(schedules[i]) - 1 for i in idx]
        outs = push_batch([streams[i] for i in idx], chunks, flags)
        for i, o in zip(idx, outs):
            got[i].append(o)
            pos[i] += schedules[i][step]
    for g, r in zip(got, refs):
        assert [x.shape[1] for x in g] == [x.shape[1] for x in r]
        assert max((x - y).abs().max().item() for x, y in zip(g, r) if y.numel()) <= 2e-5


def test_stream_errors(hift, mel):
    s = HiFTStream(hift)
    with pytest.raises(InputError, match=r"shape \(1, 80, n\)"):
        s.push(torch.zeros(1, 81, 5))
    s.push(mel[:, :, :60], finalize=True)
    with pytest.raises(InputError, match="already finalized"):
        s.push(mel[:, :, 60:70])
    short = copy.deepcopy(hift)
    short.set_noise(sine_waves=hift.sine_waves[:, :100 * 480])
    s = HiFTStream(short)
    s.push(mel[:, :, :100])  # non-final: only 97 frames of source so far
    with pytest.raises(RequestTooLongError, match="needs 101 mel frames.*holds 100"):
        s.push(mel[:, :, 100:104])
    assert s.frames == 100  # a refused push changes nothing
    with pytest.raises(InputError, match="twice"):
        push_batch([s, s], [mel[:, :, :1]] * 2, [False, False])


def test_bucketed_stream_decoder_is_exact(hift, mel):
    """Streaming through right-padded bucket windows (what the CUDA-graph path runs) equals the eager stream."""
    from cosytrt.engines.buckets import Bucket, BucketTable, ShapeStats
    from cosytrt.runtime.stages.bucketed import BucketedStreamDecoder

    table = BucketTable([Bucket("hift", "stream", b, t) for b in (1, 2) for t in (32, 48, 64, 96, 128)], 1.5)
    stats = ShapeStats()
    calls = []

    def run(bucket, m, s):
        calls.append((bucket.batch, m.shape[-1]))
        return hift.decode(m, s, finalize=False)

    ref_stream = HiFTStream(hift)
    out_stream = HiFTStream(hift, decoder=BucketedStreamDecoder(hift, run, table, stats))
    ref, out = [], []
    sched = [(0, 30, False), (30, 70, False), (70, 120, False), (120, TOTAL, True)]
    for a, b, fin in sched:
        ref.append(ref_stream.push(mel[:, :, a:b], finalize=fin))
    for a, b, fin in sched:
        out.append(out_stream.push(mel[:, :, a:b], finalize=fin))
    assert [r.shape for r in ref] == [o.shape for o in out]
    assert max(float((r - o).abs().max()) for r, o in zip(ref, out)) <= 1e-6
    s = stats.summary()["stages"]["hift/stream"]
    assert s["hits"] >= 2 and s["fallbacks"] == 1  # the final window runs eagerly
    assert all(t in (32, 48, 64, 96, 128) for _, t in calls)


def test_bucketed_stream_windows_split_over_buckets(hift, mel):
    """More streams than the largest bucket holds (or a row count no bucket fits within the padding-waste limit):
    their windows run split over buckets (BucketTable.plan: 2 + 1 here), not eagerly, with the eager samples —
    non-final and final windows alike — and the parts are counted as split, none as a fallback."""
    from cosytrt.engines.buckets import Bucket, BucketTable, ShapeStats
    from cosytrt.runtime.stages.bucketed import BucketedStreamDecoder

    lengths = (32, 48, 64, 96, 128, 192)
    table = BucketTable([Bucket("hift", "stream", b, t) for b in (1, 2) for t in lengths], 1.5)
    stats = ShapeStats()
    calls = []

    def run(bucket, m, s):
        calls.append(bucket.batch)
        return hift.decode(m, s, finalize=False)

    dec = BucketedStreamDecoder(hift, run, table, stats, lambda m, s: hift.decode(m, s, finalize=True))
    starts = (0, 10, 20)
    refs = [HiFTStream(hift) for _ in starts]
    outs = [HiFTStream(hift, decoder=dec) for _ in starts]
    for a, b, fin in ((0, 40, False), (40, 90, False), (90, 150, True)):
        r = push_batch(refs, [mel[:, :, s + a:s + b] for s in starts], [fin] * 3)
        o = push_batch(outs, [mel[:, :, s + a:s + b] for s in starts], [fin] * 3)
        assert all(x.shape == y.shape and float((x - y).abs().max()) <= 1e-5 for x, y in zip(r, o))
    st = stats.summary()["stages"]["hift/stream"]
    assert st["fallbacks"] == 0 and st["split_parts"] >= 6 and sorted(set(calls)) == [1, 2]


def test_bucketed_final_windows_are_exact(hift, mel):
    """With a tail runner, final windows run in the non-final buckets (right-padded by >= 4 zero frames) plus a final
    decode of the last decode_left_context() + 1 frames: the same samples as the eager stream, counted as hits at
    n + 4 frames; several streams' finals batch together (fp32: conv sums over another length differ by ~1e-6)."""
    from cosytrt.engines.buckets import Bucket, BucketTable, ShapeStats
    from cosytrt.runtime.stages.bucketed import BucketedStreamDecoder

    lengths = (32, 48, 64, 96, 128, 192)
    table = BucketTable([Bucket("hift", "stream", b, t) for b in (1, 2) for t in lengths], 1.5)
    stats = ShapeStats()
    tails = []

    def tail(m, s):
        tails.append(tuple(m.shape))
        return hift.decode(m, s, finalize=True)

    dec = BucketedStreamDecoder(hift, lambda bucket, m, s: hift.decode(m, s, finalize=False), table, stats, tail)
    for sched in ([(0, 30, False), (30, 70, False), (70, 120, False), (120, TOTAL, True)],
                  [(0, 60, False), (60, 181, True)]):
        ref_s, out_s = HiFTStream(hift), HiFTStream(hift, decoder=dec)
        for a, b, fin in sched:
            r, o = ref_s.push(mel[:, :, a:b], finalize=fin), out_s.push(mel[:, :, a:b], finalize=fin)
            assert r.shape == o.shape and float((r - o).abs().max()) <= 1e-5
    # two streams finishing together: one batched final window
    refs = [HiFTStream(hift), HiFTStream(hift)]
    outs = [HiFTStream(hift, decoder=dec), HiFTStream(hift, decoder=dec)]
    for streams in (refs, outs):
        push_batch(streams, [mel[:, :, :50], mel[:, :, 10:60]], [False, False])
    r = push_batch(refs, [mel[:, :, 50:150], mel[:, :, 60:160]], [True, True])
    o = push_batch(outs, [mel[:, :, 50:150], mel[:, :, 60:160]], [True, True])
    assert all(float((a - b).abs().max()) <= 1e-5 for a, b in zip(r, o))
    assert tails[-1] == (2, 80, dec.tail_frames)
    s = stats.summary()["stages"]["hift/stream"]
    assert s["fallbacks"] == 0 and s["hits"] >= 7
    # no tail runner: final windows run eagerly, as before
    plain = BucketedStreamDecoder(hift, lambda bucket, m, s: hift.decode(m, s, finalize=False), table, ShapeStats())
    w = plain(mel[:, :, :64], hift.sine_source(hift.predict_f0(mel[:, :, :64]))[:, :, :64 * 480], True)
    assert w.shape[1] == 64 * 480 and plain.stats.summary()["stages"]["hift/stream"]["fallbacks"] == 1
