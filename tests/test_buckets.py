"""Bucket keys, selection under the padding-waste bound, padding/cropping, length grouping, shape stats and the
upstream streaming schedule."""
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from cosytrt.engines.buckets import Bucket, BucketTable, ShapeStats, group_by_length, parse_key
from cosytrt.runtime.stages.hop_schedule import streaming_call_frames, streaming_schedule
from cosytrt.runtime.models.config import tiny_config
from cosytrt.engines.errors import BucketError, InputError

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")


# ------------------------------------------------------------------------------------------------------ Bucket

def test_key_roundtrip_and_properties():
    b = Bucket("dit", "stream", 4, 200)
    assert b.key == "dit/stream/b4xt200" and str(b) == b.key
    assert b.cost == 800 and not b.dynamic and b.length_range == (200, 200)
    assert parse_key("dit/stream/b4xt200") == b
    d = Bucket("dit", "offline", 2, 3072, 1024)
    assert d.key == "dit/offline/b2xt1024-3072" and d.dynamic and d.length_range == (1024, 3072)
    assert parse_key(d.key) == d
    dec = Bucket("ar", "decode", 8, 2048)
    assert dec.key == "ar/decode/b8xt2048" and dec.dynamic and parse_key(dec.key) == dec
    assert parse_key("ar/prefill/b4xt256") == Bucket("ar", "prefill", 4, 256)
    assert parse_key("hift/offline/b1xt64") == Bucket("hift", "offline", 1, 64)


@pytest.mark.parametrize("key", [
    "dit/stream/b4x200", "dit/stream/b4xt0", "dit/stream/b0xt200", "foo/stream/b4xt200", "dit/decode/b4xt200",
    "ar/stream/b1xt64", "dit/stream/b3xt200", "dit/stream/b2xt300-200", "dit/stream/b2xt1-128",
    "dit/stream/b04xt128", "dit/stream/b4xt200 ", "", "dit/stream", 42,
])
def test_parse_key_rejects(key):
    with pytest.raises(BucketError):
        parse_key(key)


def test_bucket_validation():
    with pytest.raises(BucketError, match="even"):
        Bucket("dit", "stream", 3, 100)
    with pytest.raises(BucketError, match="length"):
        Bucket("hift", "stream", 1, 0)
    with pytest.raises(BucketError, match="batch"):
        Bucket("hift", "stream", True, 64)
    with pytest.raises(BucketError, match="min_length"):
        Bucket("hift", "stream", 1, 64, 65)
    with pytest.raises(BucketError, match="unknown mode"):
        Bucket("ar", "offline", 1, 64)


def test_covers_and_waste():
    b = Bucket("hift", "offline", 4, 128)
    assert b.covers(4, 128) and b.covers(1, 1) and not b.covers(5, 10) and not b.covers(1, 129)
    assert b.waste(4, 128) == 1.0
    assert b.waste(1, 10) == pytest.approx(51.2)
    assert b.waste(3, 100) == pytest.approx(512 / 300)
    d = Bucket("hift", "offline", 2, 512, 128)   # dynamic: pads the batch only
    assert not d.covers(2, 127) and d.covers(2, 128) and d.covers(1, 512)
    assert d.run_length(300) == 300 and d.waste(1, 300) == 2.0 and d.waste(2, 300) == 1.0
    dec = Bucket("ar", "decode", 8, 2048)
    assert dec.waste(5, 300) == pytest.approx(1.6) and dec.waste(6, 1) == pytest.approx(8 / 6)


# ------------------------------------------------------------------------------------------------- selection

SMALL = BucketTable([Bucket("hift", "offline", b, n) for b in (4, 1) for n in (256, 64, 128)])

SELECT_CASES = [
    # (b, n) -> expected bucket key (None: eager fallback)
    ((1, 64), "hift/offline/b1xt64"),      # exact fit
    ((1, 50), "hift/offline/b1xt64"),      # waste 1.28
    ((1, 43), "hift/offline/b1xt64"),      # 1.488
    ((1, 42), None),                       # 64/42 = 1.524 > 1.5
    ((1, 100), "hift/offline/b1xt128"),    # cheapest: 128 < 256 < 4x128
    ((1, 80), None),                       # 128/80 = 1.6
    ((1, 86), "hift/offline/b1xt128"),     # 1.488
    ((1, 256), "hift/offline/b1xt256"),    # exact fit
    ((2, 64), None),                       # 4x64 / 2x64 = 2.0
    ((3, 64), "hift/offline/b4xt64"),      # 1.333
    ((3, 60), "hift/offline/b4xt64"),      # 256/180 = 1.422
    ((4, 128), "hift/offline/b4xt128"),    # exact fit
    ((4, 200), "hift/offline/b4xt256"),    # 1.28
    ((3, 200), None),                      # 1024/600 = 1.71
    ((5, 10), None),                       # no bucket has batch 5
    ((1, 300), None),                      # no bucket is that long
]


@pytest.mark.parametrize("call,expected", SELECT_CASES)
def test_select_table(call, expected):
    got = SMALL.select(*call)
    assert (got.key if got else None) == expected
    if got:
        assert got.waste(*call) <= 1.5


def test_table_is_sorted_by_cost():
    assert [b.key for b in SMALL] == ["hift/offline/b1xt64", "hift/offline/b1xt128", "hift/offline/b1xt256",
                                      "hift/offline/b4xt64", "hift/offline/b4xt128", "hift/offline/b4xt256"]
    assert SMALL.max_batch == 4 and SMALL.max_length == 256 and len(SMALL) == 6
    assert "hift/offline/b4xt128" in SMALL and SMALL.get("hift/offline/b4xt128").cost == 512
    with pytest.raises(BucketError, match="unknown bucket"):
        SMALL.get("hift/offline/b2xt64")


def test_waste_bound_forces_fallback_and_allow_waste():
    t = BucketTable([Bucket("hift", "stream", 4, 128)])
    assert t.select(1, 10) is None
    assert t.miss_reason(1, 10) == "waste"
    assert "51.200 > limit 1.5" in t.explain(1, 10)
    assert t.select(1, 10, allow_waste=True).key == "hift/stream/b4xt128"
    assert t.select(4, 100).key == "hift/stream/b4xt128"          # 1.28
    assert "b4xt128 (padding waste 1.280 <= 1.5)" in t.explain(4, 100)
    assert t.select(5, 10, allow_waste=True) is None              # nothing covers
    assert t.miss_reason(5, 10) == "no_cover" and "no bucket covers" in t.explain(5, 10)
    assert t.miss_reason(4, 100) is None
    loose = BucketTable([Bucket("hift", "stream", 4, 128)], max_padding_waste=100)
    assert loose.select(1, 10).key == "hift/stream/b4xt128"
    empty = BucketTable([])
    assert empty.select(1, 1) is None and empty.miss_reason(1, 1) == "empty_table"


def _dit_table(batches=(2, 4, 8), lengths=(768,), limit=1.5):
    return BucketTable([Bucket("dit", "offline", b, n) for b in batches for n in lengths], max_padding_waste=limit)


@pytest.mark.parametrize("call, expected", [
    ((8, 700), [(8, "b8xt768")]),                          # a plain hit: one chunk
    ((6, 620), [(4, "b4xt768"), (2, "b2xt768")]),          # b8 would waste 1.65x: split, no eager call
    ((20, 700), [(8, "b8xt768"), (8, "b8xt768"), (4, "b4xt768")]),   # more rows than any bucket
    ((2, 100), [(2, None)]),                               # too short for any bucket within the limit: eager
    ((4, 900), [(4, None)]),                               # longer than every bucket: cannot split over time
])
def test_plan_splits_rows_over_buckets_before_falling_back(call, expected):
    """BucketTable.plan: one chunk when select hits; otherwise the call's (independent) rows split into chunks that
    each hit a bucket within the padding-waste limit, most rows first; what no bucket takes stays eager."""
    got = [(k, bk.key.split("/")[-1] if bk is not None else None) for k, bk in _dit_table().plan(*call)]
    assert got == expected
    assert sum(k for k, _ in got) == call[0]


def test_plan_leaves_an_untakeable_remainder_eager():
    t = _dit_table(batches=(4,), lengths=(700,))
    assert [(k, bk and bk.key) for k, bk in t.plan(6, 650)] == [(4, "dit/offline/b4xt700"), (2, None)]


def test_dynamic_bucket_selection():
    t = BucketTable([Bucket("dit", "offline", 2, 2048), Bucket("dit", "offline", 2, 3072, 1024)])
    # 1500 frames: the static 2048 runs 2 x 2048 row-frames, the dynamic one runs at 2 x 1500: cheaper, waste 1.0
    assert t.select(2, 1500).key == "dit/offline/b2xt1024-3072"
    assert t.select(2, 1500).waste(2, 1500) == 1.0
    assert t.select(2, 2500).key == "dit/offline/b2xt1024-3072"
    assert t.select(2, 1024).key == "dit/offline/b2xt1024-3072"
    # 1000 is below the dynamic range; the static bucket pads 4096 / 2000 = 2.05 > 1.5
    assert t.select(2, 1000) is None
    assert t.select(2, 1000, allow_waste=True).key == "dit/offline/b2xt2048"
    assert t.select(2, 3073) is None


def test_table_rejects_mixed_and_duplicates():
    with pytest.raises(BucketError, match="one stage/mode"):
        BucketTable([Bucket("hift", "stream", 1, 64), Bucket("hift", "offline", 1, 64)])
    with pytest.raises(BucketError, match="duplicate"):
        BucketTable([Bucket("hift", "stream", 1, 64), Bucket("hift", "stream", 1, 64)])
    with pytest.raises(BucketError, match="max_padding_waste"):
        BucketTable([], max_padding_waste=0.5)
    with pytest.raises(BucketError, match="call batch"):
        SMALL.select(0, 10)
    with pytest.raises(BucketError, match="call length"):
        SMALL.select(1, 2.5)


# -------------------------------------------------------------------------------------------- group_by_length

LENS = [100, 30, 95, 60, 200, 58, 10, 190]


@pytest.mark.parametrize("kw,expected", [
    # sorted: 10(6) 30(1) 58(5) 60(3) 95(2) 100(0) 190(7) 200(4)
    # [6,1]: 30*2 = 60 <= 1.5*40 (exact); +58: 58*3 = 174 > 147; [5,3,2]: 95*3 = 285 <= 319.5; +100: n=4 > 3;
    # [0,7,4]: 200*3 = 600 <= 735
    ({"max_batch": 3}, [[6, 1], [5, 3, 2], [0, 7, 4]]),
    # max_frames 400 splits 200 off: [0,7] 380 <= 400, +200 -> 600 > 400
    ({"max_batch": 3, "max_frames": 400}, [[6, 1], [5, 3, 2], [0, 7], [4]]),
    # max_frames 150: 190 and 200 alone exceed it and still get their own groups
    ({"max_batch": 3, "max_frames": 150}, [[6, 1], [5, 3], [2], [0], [7], [4]]),
    # max_batch 8: [5,3,2,0] 100*4 = 400 <= 469.5, +190: 190*5 = 950 > 754.5; [7,4] 400 <= 585
    ({"max_batch": 8}, [[6, 1], [5, 3, 2, 0], [7, 4]]),
    ({"max_batch": 1}, [[6], [1], [5], [3], [2], [0], [7], [4]]),
    ({"max_batch": 8, "max_padding_waste": 1.0}, [[6], [1], [5], [3], [2], [0], [7], [4]]),
])
def test_group_by_length_fixed(kw, expected):
    assert group_by_length(LENS, **kw) == expected


def test_group_by_length_equal_lengths_and_bound_property():
    assert group_by_length([5, 5, 7], max_batch=4, max_padding_waste=1.0) == [[0, 1], [2]]
    rng = random.Random(7)
    for trial in range(200):
        lens = [rng.randint(1, 600) for _ in range(rng.randint(1, 40))]
        mb, w = rng.randint(1, 16), rng.choice([1.0, 1.2, 1.5, 2.0])
        mf = rng.choice([None, 800, 3000])
        groups = group_by_length(lens, mb, w, mf)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        for g in groups:
            ls = [lens[i] for i in g]
            assert len(g) <= mb and max(ls) * len(g) <= w * sum(ls) + 1e-9
            assert len(g) == 1 or mf is None or max(ls) * len(g) <= mf


def test_group_by_length_errors():
    with pytest.raises(BucketError):
        group_by_length([10, 0], 4)
    with pytest.raises(BucketError):
        group_by_length([10], 0)
    with pytest.raises(BucketError):
        group_by_length([10], 2, max_padding_waste=0.9)
    assert group_by_length([], 4) == []


# ------------------------------------------------------------------------------------------------- ShapeStats

def test_shape_stats_summary():
    s = ShapeStats()
    t = BucketTable([Bucket("hift", "stream", 4, 128)])
    s.record("hift", "stream", 4, 128, t.select(4, 128), 0.010)
    s.record("hift", "stream", 4, 100, t.select(4, 100), 0.020)
    s.record("hift", "stream", 1, 10, t.select(1, 10), 0.005, reason=t.miss_reason(1, 10))
    s.record("hift", "stream", 1, 10, None, 0.007, reason="waste")
    s.record("dit", "offline", 2, 300, None, 0.5, reason="no_cover")
    d = s.summary()
    assert d["calls"] == 5 and d["hits"] == 2 and d["fallbacks"] == 3
    assert d["hit_rate"] == pytest.approx(0.4) and d["seconds"] == pytest.approx(0.542)
    hs = d["stages"]["hift/stream"]
    assert hs["calls"] == 4 and hs["hits"] == 2 and hs["fallbacks"] == 2
    assert hs["waste"]["samples"] == [1.0, 1.28] and hs["waste"]["max"] == 1.28
    assert hs["waste"]["mean"] == pytest.approx(1.14)
    assert hs["fallback_reasons"] == {"waste": 2}
    assert d["stages"]["dit/offline"]["waste"]["mean"] is None
    bk = d["buckets"]["hift/stream/b4xt128"]
    assert bk["hits"] == 2 and bk["seconds"] == pytest.approx(0.03) and bk["mean_waste"] == pytest.approx(1.14)
    assert d["fallback_shapes"] == [
        {"stage_mode": "dit/offline", "b": 2, "n": 300, "count": 1, "seconds": 0.5, "reason": "no_cover"},
        {"stage_mode": "hift/stream", "b": 1, "n": 10, "count": 2, "seconds": pytest.approx(0.012),
         "reason": "waste"}]
    with pytest.raises(BucketError):
        s.record("dit", "stream", 2, 10, Bucket("hift", "stream", 4, 128), 0.1)
    s.reset()
    assert s.summary()["calls"] == 0 and s.summary()["hit_rate"] is None


# ------------------------------------------------------------------------------------------ streaming schedule

def test_streaming_call_frames_golden_schedule():
    # tests/data/golden/README.md: P=20, 120 tokens; first hop 25 + 5 pad, second hop 50, final on all
    assert streaming_call_frames(20, 120) == [2 * (20 + 30), 2 * (20 + 80), 2 * (20 + 120)]
    assert streaming_call_frames(20, 120) == [100, 200, 280]
    assert streaming_call_frames(20, 120, stage="hift") == [60, 160, 240]
    calls = streaming_schedule(20, 120)
    assert [(c.token_offset, c.hop, c.dit_tokens, c.final) for c in calls] == [
        (0, 30, 33, False), (30, 50, 83, False), (80, 40, 120, True)]
    assert [c.new_mel_frames for c in calls] == [60, 100, 80]


def test_streaming_schedule_matches_golden_chunk_lengths():
    # non-final HiFT holds back f0 look-right + conv_pre look-right + 1 frames; the final emits everything
    h = tiny_config().hift
    hold = h.f0_look_right + h.conv_pre_look_right + 1
    sent, chunks = 0, []
    for c in streaming_schedule(20, 120):
        upto = c.hift_frames * h.samples_per_frame if c.final else (c.hift_frames - hold) * h.samples_per_frame
        chunks.append(upto - sent)
        sent = upto
    golden = load_file(os.path.join(GOLDEN, "stream_vectors.safetensors"))["stream.chunk_lengths"].tolist()
    assert chunks == golden == [24960, 48000, 42240]


def test_streaming_schedule_shapes():
    assert streaming_call_frames(25, 200) == [2 * 50, 2 * 100, 2 * 200, 2 * 225]   # no pad; hops 25, 50, 100
    assert streaming_call_frames(0, 30) == [50, 60]                                # first call 25 (+3 context)
    assert streaming_call_frames(20, 10) == [60]                                   # too short: final only
    assert streaming_call_frames(20, 33) == [100, 106]                             # hop fires at exactly 33
    assert streaming_call_frames(20, 32) == [104]
    # hops cap at 100 tokens: P=75 -> DiT frames of 100, 150, 250, 350, 450 tokens; final 500
    assert streaming_call_frames(75, 425) == [200, 300, 500, 700, 900, 1000]
    # every non-final DiT call is 50k frames (prompt + hop ends on a chunk boundary)
    for P in (1, 24, 75, 99, 250):
        for c in streaming_schedule(P, 700)[:-1]:
            assert c.dit_frames % 50 == 0
    with pytest.raises(InputError):
        streaming_schedule(20, 0)
    with pytest.raises(InputError):
        streaming_schedule(-1, 10)
    with pytest.raises(BucketError):
        streaming_call_frames(20, 120, stage="ar")
