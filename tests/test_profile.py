"""Bucket profiles: the shipped default/tiny profiles load and cover what they claim; malformed ones are rejected
with a ProfileError naming the file, the key path and the value."""
import textwrap

import pytest

from cosytrt.engines.buckets import Bucket
from cosytrt.runtime.stages.hop_schedule import streaming_schedule
from cosytrt.engines.errors import BucketError, ProfileError
from cosytrt.runtime.stages.profile import load_profile, profile_from_dict

BASE = """\
model: tiny
dtype: float16
stages:
  dit:
    stream: {batch: [2, 4], frames: [64, 128]}
  hift:
    offline: {batch: [1, 2], frames: [64, 128]}
  ar:
    max_seq_len: 512
    decode_batch: [1, 2]
    prefill: {batch: [1], tokens: [64]}
"""


def write(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


# ------------------------------------------------------------------------------------------------ shipped profiles

def test_default_profile_loads():
    p = load_profile("default")
    assert p.model == "full" and p.dtype == "float16" and p.max_padding_waste == 1.5
    assert p.source.endswith("default.yaml")
    assert p.stages["dit"].dtype == "bfloat16" and p.stages["hift"].dtype == "float32"
    assert p.stages["ar"].dtype == "float16" and p.stages["ar"].max_seq_len == 2048
    assert p.stages["dit"].options == {"opt_level": 3, "workspace_gb": 8}
    counts = {(s, m): len(p.buckets(s, m)) for s, m in (("dit", "stream"), ("dit", "offline"), ("hift", "stream"),
                                                         ("hift", "offline"), ("ar", "decode"), ("ar", "prefill"))}
    assert counts == {("dit", "stream"): 32, ("dit", "offline"): 28, ("hift", "stream"): 40,
                      ("hift", "offline"): 40, ("ar", "decode"): 12, ("ar", "prefill"): 18}
    for s, m in counts:
        bs = p.buckets(s, m)
        assert [b.cost for b in bs] == sorted(b.cost for b in bs)
        assert all(not b.dynamic for b in bs) or s == "ar"
    assert p.buckets("ar", "decode")[0] == Bucket("ar", "decode", 1, 2048)
    # every non-final streaming DiT length (50k frames) that is a rung fits exactly
    assert sorted({b.length for b in p.buckets("dit", "stream")}) == [150, 200, 300, 450, 650, 950, 1400, 2100]
    assert all(b.length % 50 == 0 for b in p.buckets("dit", "stream"))
    assert len(p.all_buckets()) == 170


def test_tiny_profile_loads():
    p = load_profile("tiny")
    assert p.model == "tiny" and p.dtype == "float32" and p.model_config().name == "tiny"
    assert [b.key for b in p.buckets("dit", "stream")] == [
        "dit/stream/b2xt64", "dit/stream/b2xt128", "dit/stream/b4xt64", "dit/stream/b2xt192",
        "dit/stream/b4xt128", "dit/stream/b2xt288", "dit/stream/b4xt192", "dit/stream/b2xt432", "dit/stream/b4xt288",
        "dit/stream/b2xt648", "dit/stream/b4xt432", "dit/stream/b4xt648"]
    assert [b.key for b in p.buckets("ar", "decode")] == ["ar/decode/b1xt512", "ar/decode/b2xt512",
                                                           "ar/decode/b4xt512"]
    assert [b.key for b in p.buckets("ar", "prefill")] == ["ar/prefill/b1xt64", "ar/prefill/b1xt128",
                                                            "ar/prefill/b2xt64", "ar/prefill/b2xt128"]
    assert p.stages["hift"].dtype == "float32"


def test_tiny_profile_covers_golden_requests():
    p = load_profile("tiny")
    dit_s, hift_s = p.table("dit", "stream"), p.table("hift", "stream")
    calls = streaming_schedule(20, 120)
    assert [dit_s.select(2, c.dit_frames).key for c in calls] == [
        "dit/stream/b2xt128", "dit/stream/b2xt288", "dit/stream/b2xt288"]
    assert [hift_s.select(1, c.hift_frames).key for c in calls] == [
        "hift/stream/b1xt64", "hift/stream/b1xt192", "hift/stream/b1xt256"]
    assert p.table("dit", "offline").select(2, 100).key == "dit/offline/b2xt128"      # flow golden P=20 + N=30
    assert p.table("hift", "offline").select(1, 60).key == "hift/offline/b1xt64"      # hift golden
    assert p.table("ar", "prefill").select(1, 54).key == "ar/prefill/b1xt64"          # llm golden lm_input
    assert p.table("dit", "offline").select(2, 280).key == "dit/offline/b2xt288"      # stream golden offline


def test_default_covers_typical_range_within_waste():
    """Prompt 3-10 s (75-250 tokens), target 1-30 s (25-750 tokens): every call at every ladder batch hits."""
    p = load_profile("default")
    dit_stream, hift_stream, dit_off, hift_off = set(), set(), set(), set()
    for P in range(75, 251):
        for N in range(25, 751):
            for c in streaming_schedule(P, N):
                dit_stream.add(c.dit_frames)
                hift_stream.add(c.hift_frames)
            dit_off.add(2 * (P + N))
            hift_off.add(2 * N)
    assert min(dit_stream) == 200 and max(dit_stream) == 2000
    assert min(hift_stream) == 50 and max(hift_stream) == 1500
    worst = {}
    for (stage, mode), lens in {("dit", "stream"): dit_stream, ("hift", "stream"): hift_stream,
                                ("dit", "offline"): dit_off, ("hift", "offline"): hift_off}.items():
        t = p.table(stage, mode)
        for b in sorted({bk.batch for bk in t}):
            for n in lens:
                bk = t.select(b, n)
                assert bk is not None, t.explain(b, n)
                assert bk.batch == b and bk.waste(b, n) <= 1.5
                worst[stage, mode] = max(worst.get((stage, mode), 0), bk.waste(b, n))
    assert all(1.4 < w <= 1.5 for w in worst.values()), worst
    # the hop-aligned DiT rungs are contiguous at waste <= 1.5 from 104 frames up
    t = p.table("dit", "stream")
    assert all(t.select(2, n) is not None for n in range(100, 2101))
    assert t.select(2, 99) is None and t.select(2, 2101) is None
    # AR: any decode batch 1..64 (batch padding only), prefill 100-600 tokens at the ladder batches
    dec = p.table("ar", "decode")
    for b in range(1, 65):
        for kv in (1, 700, 2048):
            assert dec.select(b, kv) is not None, dec.explain(b, kv)
    pre = p.table("ar", "prefill")
    assert all(pre.select(b, n) is not None for b in (1, 2, 4) for n in range(100, 601))


def test_roundtrip_and_hashes(tmp_path):
    for name in ("default", "tiny"):
        p = load_profile(name)
        d = p.to_dict()
        q = profile_from_dict(d)
        assert q == p and q.profile_hash() == p.profile_hash()
        assert load_profile(name).profile_hash() == p.profile_hash()          # stable across loads
        assert all(q.profile_hash(s) == p.profile_hash(s) for s in ("ar", "dit", "hift"))
    a = load_profile(write(tmp_path, BASE, "a.yaml"))
    h = a.profile_hash()
    assert len(h) == 16 and int(h, 16) >= 0
    # unsorted lists and the explicit bucket form normalise to the same profile and hash
    b = load_profile(write(tmp_path, BASE.replace("batch: [2, 4], frames: [64, 128]",
                                                  "buckets: [{batch: 4, frames: 128}, {batch: 2, frames: 64},"
                                                  " {batch: 4, frames: 64}, {batch: 2, frames: 128}]"), "b.yaml"))
    assert b == a and b.profile_hash() == h
    c = load_profile(write(tmp_path, BASE.replace("batch: [2, 4], frames: [64, 128]",
                                                  "batch: [4, 2], frames: [128, 64]"), "c.yaml"))
    assert c == a and c.profile_hash() == h
    # a description is not hashed; a runtime-only change keeps the stage hashes; a new bucket changes only its stage
    desc = load_profile(write(tmp_path, "description: hello\n" + BASE, "d.yaml"))
    assert desc.profile_hash() == h
    waste = load_profile(write(tmp_path, BASE.replace("dtype: float16\n", "dtype: float16\nmax_padding_waste: 2\n"),
                               "w.yaml"))
    assert waste.profile_hash() != h and all(waste.profile_hash(s) == a.profile_hash(s) for s in ("ar", "dit",
                                                                                                   "hift"))
    more = load_profile(write(tmp_path, BASE.replace("frames: [64, 128]}\n  hift", "frames: [64, 128, 256]}\n  hift"),
                              "m.yaml"))
    assert more.profile_hash("dit") != a.profile_hash("dit")
    assert more.profile_hash("hift") == a.profile_hash("hift") and more.profile_hash("ar") == a.profile_hash("ar")
    bk = Bucket("dit", "stream", 2, 64)
    assert more.bucket_hash(bk) == a.bucket_hash(bk)
    assert a.bucket_hash(bk) != a.bucket_hash(Bucket("dit", "stream", 4, 64))
    with pytest.raises(ProfileError, match="not in this profile"):
        a.bucket_hash(Bucket("dit", "stream", 2, 256))


def test_profile_accessors(tmp_path):
    p = load_profile(write(tmp_path, BASE))
    assert p.buckets("dit", "offline") == [] and p.table("dit", "offline").select(2, 10) is None
    assert p.stages["hift"].dtype == "float32"                  # HiFT does not inherit the top-level float16
    assert p.table("hift", "offline").select(2, 100).key == "hift/offline/b2xt128"
    with pytest.raises(BucketError, match="unknown mode"):
        p.buckets("dit", "decode")
    with pytest.raises(BucketError, match="unknown stage"):
        p.buckets("vocoder", "stream")
    with pytest.raises(BucketError, match="unknown stage"):
        p.stage("vocoder")
    only_dit = load_profile(write(tmp_path, "model: full\nstages:\n  dit:\n    offline: {batch: [2], frames: [256]}\n",
                                  "o.yaml"))
    assert only_dit.stage("ar") is None and only_dit.buckets("ar", "decode") == []
    assert only_dit.profile_hash("ar") != only_dit.profile_hash("dit")
    assert only_dit.dtype == "float32" and only_dit.max_padding_waste == 1.5


def test_dynamic_bucket_in_profile(tmp_path):
    p = load_profile(write(tmp_path, """\
        model: full
        stages:
          dit:
            offline:
              batch: [2]
              frames: [2048]
              buckets: [{batch: 2, frames: 3072, min_frames: 1024}]
        """))
    bs = p.buckets("dit", "offline")
    assert [b.key for b in bs] == ["dit/offline/b2xt2048", "dit/offline/b2xt1024-3072"]
    assert p.to_dict()["stages"]["dit"]["offline"]["buckets"][1] == {"batch": 2, "frames": 3072, "min_frames": 1024}
    assert profile_from_dict(p.to_dict()) == p


def test_reduced_precision_hift_needs_opt_in(tmp_path):
    text = BASE.replace("  hift:\n", "  hift:\n    dtype: bfloat16\n    allow_reduced_precision: true\n")
    p = load_profile(write(tmp_path, text))
    assert p.stages["hift"].dtype == "bfloat16" and p.stages["hift"].allow_reduced_precision


# ---------------------------------------------------------------------------------------------- malformed profiles

def _sub(old, new):
    assert old in BASE, old
    return BASE.replace(old, new)


BAD = [
    # (profile text, key path the message must name, value repr it must show or None)
    ("modle: full\n" + BASE, "modle", None),
    (_sub("model: tiny", "model: huge"), "model", "'huge'"),
    (BASE.replace("model: tiny\n", ""), "model", None),
    (_sub("frames: [64, 128]}\n  hift", "fames: [64, 128]}\n  hift"), "stages.dit.stream.fames", None),
    (_sub("batch: [2, 4]", 'batch: "2,4"'), "stages.dit.stream.batch", "'2,4'"),
    (_sub("batch: [2, 4]", "batch: 4"), "stages.dit.stream.batch", "4"),
    (_sub("frames: [64, 128]}\n  hift", "frames: [0, 128]}\n  hift"), "stages.dit.stream.frames[0]", "0"),
    (_sub("frames: [64, 128]}\n  hift", "frames: [-64, 128]}\n  hift"), "stages.dit.stream.frames[0]", "-64"),
    (_sub("frames: [64, 128]}\n  hift", "frames: [64.5, 128]}\n  hift"), "stages.dit.stream.frames[0]", "64.5"),
    (_sub("frames: [64, 128]}\n  hift", "frames: [64, '128']}\n  hift"), "stages.dit.stream.frames[1]", "'128'"),
    (_sub("offline: {batch: [1, 2]", "offline: {batch: [true, 2]"), "stages.hift.offline.batch[0]", "True"),
    (_sub("batch: [2, 4]", "batch: [2, 3]"), "stages.dit.stream.batch[1]", "3"),
    (_sub("batch: [2, 4]", "batch: [4, 4]"), "stages.dit.stream.batch[1]", "4"),
    (_sub("stream: {batch: [2, 4], frames: [64, 128]}",
          "stream: {batch: [2, 4], frames: [64, 128], buckets: [{batch: 2, frames: 64}]}"),
     "stages.dit.stream.buckets[0]", None),
    (_sub("offline: {batch: [1, 2], frames: [64, 128]}",
          "offline: {buckets: [{batch: 1, frames: 64}, {batch: 1, frames: 64}]}"),
     "stages.hift.offline.buckets[1]", None),
    (_sub("dtype: float16", "dtype: float8"), "dtype", "'float8'"),
    (_sub("  dit:\n", "  dit:\n    dtype: int8\n"), "stages.dit.dtype", "'int8'"),
    (_sub("dtype: float16", "dtype: float16\nmax_padding_waste: 0.9"), "max_padding_waste", "0.9"),
    (_sub("  dit:\n", "  dit:\n    max_padding_waste: 0.5\n"), "stages.dit.max_padding_waste", "0.5"),
    (_sub("  dit:\n", "  dit:\n    max_padding_waste: lots\n"), "stages.dit.max_padding_waste", "'lots'"),
    (_sub("offline: {batch: [1, 2], frames: [64, 128]}",
          "offline: {buckets: [{batch: 1, frames: 64, min_frames: 65}]}"),
     "stages.hift.offline.buckets[0].min_frames", "65"),
    (_sub("offline: {batch: [1, 2], frames: [64, 128]}", "offline: {buckets: [{batch: 1, frame: 64}]}"),
     "stages.hift.offline.buckets[0].frame", None),
    (_sub("  hift:\n", "  hift:\n    dtype: float16\n"), "stages.hift.dtype", "'float16'"),
    (_sub("  hift:\n", "  hift:\n    allow_reduced_precision: yes please\n"),
     "stages.hift.allow_reduced_precision", "'yes please'"),
    (_sub("  hift:\n    offline: {batch: [1, 2], frames: [64, 128]}\n", "  hift: {}\n"), "stages.hift", None),
    (_sub("  hift:\n    offline: {batch: [1, 2], frames: [64, 128]}\n", "  hift:\n"), "stages.hift", None),
    (_sub("  hift:\n    offline: {batch: [1, 2], frames: [64, 128]}\n", "  hift:\n    dtype: float32\n"),
     "stages.hift", None),
    (_sub("stream: {batch: [2, 4], frames: [64, 128]}", "stream: {}"), "stages.dit.stream", None),
    (_sub("stream: {batch: [2, 4], frames: [64, 128]}", "stream: {batch: [], frames: [64]}"),
     "stages.dit.stream.batch", None),
    (_sub("stream: {batch: [2, 4], frames: [64, 128]}", "stream: {batch: [2, 4]}"), "stages.dit.stream.frames",
     None),
    ("model: tiny\nstages: {}\n", "stages", None),
    ("model: tiny\n", "stages", None),
    (_sub("  ar:\n", "  vocoder:\n    stream: {batch: [1], frames: [64]}\n  ar:\n"), "stages.vocoder", None),
    (_sub("    max_seq_len: 512\n", ""), "stages.ar.max_seq_len", None),
    (_sub("max_seq_len: 512", "max_seq_len: 8192"), "stages.ar.max_seq_len", "8192"),     # tiny: 4096 positions
    (_sub("tokens: [64]", "tokens: [1024]"), "stages.ar.prefill.tokens[0]", "1024"),    # > max_seq_len
    (_sub("decode_batch: [1, 2]", "decode_batch: [1, 0]"), "stages.ar.decode_batch[1]", "0"),
    (_sub("frames: [64, 128]}\n  hift", "frames: [64, 4000]}\n  hift"), "stages.dit.stream.frames[1]", "4000"),
    (_sub("  dit:\n", "  dit:\n    options: [1, 2]\n"), "stages.dit.options", "[1, 2]"),
    (_sub("dtype: float16", "dtype: float16\ndtype: float32"), "line 3", "'dtype' given twice"),  # YAML dup key
    ("model: tiny\nstages: [dit\n", None, None),                                           # not YAML
    ("- model\n- tiny\n", "(top level)", None),
    ("", "(top level)", None),
]


@pytest.mark.parametrize("text,keypath,value", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_malformed_profile(tmp_path, text, keypath, value):
    path = write(tmp_path, text, "bad.yaml")
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    msg = str(e.value)
    assert path in msg
    if keypath is not None:
        assert f": {keypath}" in msg, msg
    if value is not None:
        assert value in msg, msg


def test_malformed_messages_read_well(tmp_path):
    path = write(tmp_path, _sub("batch: [2, 4]", "batch: [2, 3]"))
    with pytest.raises(ProfileError) as e:
        load_profile(path)
    assert str(e.value) == (f"{path}: stages.dit.stream.batch[1]: DiT batch counts CFG rows (2 per request) and "
                            f"must be even, got 3")
    path = write(tmp_path, _sub("stream: {batch: [2, 4], frames: [64, 128]}",
                                "stream: {batch: [2, 4], frames: [64, 128], buckets: [{batch: 2, frames: 64}]}"))
    with pytest.raises(ProfileError, match=r"duplicate bucket dit/stream/b2xt64 \(also given at stages\.dit\.stream "
                                           r"\(grid batch 2 x frames 64\)\)"):
        load_profile(path)


def test_missing_file_and_unknown_name(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ProfileError, match="profile file not found: .*nope.yaml"):
        load_profile(missing)
    with pytest.raises(ProfileError, match=r"not found: fast \(shipped profiles: default, tiny, h200-graphs, h200-open-loop, h200-cached-open-loop, h200-cached-open-loop-b16, h200-mixed\)"):
        load_profile("fast")
    with pytest.raises(ProfileError):
        load_profile(42)
    with pytest.raises(ProfileError, match="<dict>: stages"):
        profile_from_dict({"model": "full"})


def test_profile_size_and_grid_bounds(tmp_path):
    """A profile is bounded before any grid is built: a 2000 x 3000 grid (6 million buckets) took 1 min 44 s and
    ~6 GB to validate; a binary or unreadable file is a ProfileError naming it, not a UnicodeDecodeError."""
    import time

    def dit(batch, frames, **extra):
        return {"model": "tiny", "stages": {"dit": {"offline": {"batch": batch, "frames": frames}, **extra}}}

    t0 = time.perf_counter()
    with pytest.raises(ProfileError, match="at most 256"):
        profile_from_dict(dit(list(range(2, 4002, 2)), list(range(1, 3001))))
    with pytest.raises(ProfileError, match="buckets; at most 2048"):
        profile_from_dict(dit(list(range(2, 202, 2)), list(range(1, 201))))
    with pytest.raises(ProfileError, match="buckets; at most 2048"):
        profile_from_dict(dit([2], [8], cached={"batch": list(range(1, 21)), "frames": list(range(1, 21)),
                                                "prefix": list(range(0, 20))}))
    assert time.perf_counter() - t0 < 2
    assert len(profile_from_dict(dit([2, 4], [8, 16])).stages["dit"].modes["offline"]) == 4
    binary = tmp_path / "p.yaml"
    binary.write_bytes(b"\xff\xfe\x00model: tiny")
    with pytest.raises(ProfileError, match="not UTF-8"):
        load_profile(str(binary))
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ProfileError, match="KiB"):
        load_profile(str(huge))
