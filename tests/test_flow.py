"""Flow stage (tokens -> mel): golden parity, checkpoint validation, noise buffer, ragged batching."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cosytrt.runtime.models.checkpoint import read_state_dict
from cosytrt.runtime.models.config import config_from_golden_json, full_config
from cosytrt.runtime.models.dit import attention_mask
from cosytrt.engines.errors import CheckpointError, InputError, RequestTooLongError
from cosytrt.runtime.models.flow import Flow, FlowInput

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "golden")
FLOW_TOL = 1e-3
BATCH_TOL = 1e-4


@pytest.fixture(scope="module")
def vectors():
    return load_file(os.path.join(GOLDEN, "vectors.safetensors"))


@pytest.fixture(scope="module")
def tiny_cfg():
    return config_from_golden_json(os.path.join(GOLDEN, "config.json")).flow


@pytest.fixture(scope="module")
def golden_sd():
    return read_state_dict(os.path.join(GOLDEN, "flow.pt"))


@pytest.fixture(scope="module")
def flow(tiny_cfg, golden_sd):
    """Golden weights, default (seed-0) noise of 3000 frames."""
    return Flow(tiny_cfg).eval().load_checkpoint(golden_sd)


@pytest.fixture(scope="module")
def golden_flow(tiny_cfg, golden_sd, vectors):
    """Golden weights and the golden 108-frame noise."""
    f = Flow(tiny_cfg).eval().load_checkpoint(golden_sd)
    f.set_noise(vectors["flow.rand_noise"])
    return f


# ------------------------------------------------------------------------------------------------------ golden

@pytest.mark.parametrize("name,streaming,finalize", [("offline", False, True), ("stream", True, False),
                                                     ("stream_final", True, True)])
def test_golden_mel(golden_flow, vectors, name, streaming, finalize):
    mel = golden_flow.inference(vectors["flow.token"], vectors["flow.prompt_token"], vectors["flow.prompt_feat"],
                                vectors["flow.embedding"], streaming=streaming, finalize=finalize)
    ref = vectors[f"flow.{name}.mel"]
    assert mel.shape == ref.shape
    assert mel.dtype == torch.float32
    err = (mel - ref).abs().max().item()
    assert err <= FLOW_TOL, f"{name}: max abs err {err}"


def test_streaming_mask_matters(vectors):
    # sanity: the golden streaming and offline outputs differ, so the parity above checks the mask
    assert (vectors["flow.offline.mel"] - vectors["flow.stream_final.mel"]).abs().max() > 0.05


def test_default_noise_is_upstream_seed0(tiny_cfg, vectors):
    f = Flow(tiny_cfg)
    ref = vectors["flow.rand_noise"]
    assert f.rand_noise.shape == (1, 80, tiny_cfg.max_mel_frames)
    assert torch.equal(f.rand_noise[:, :, :ref.shape[2]], ref)
    assert "rand_noise" not in f.state_dict()


def test_stream_prefix_matches_chunked_call(flow, vectors):
    # a non-final call on a prefix gives the same mel as the finalized call on the frames it covers (first chunk)
    P = vectors["flow.prompt_token"].shape[1]
    pad = (-P) % 25
    hop = 25 + pad
    extra = torch.randint(0, 6561, (1, 30), generator=torch.Generator().manual_seed(3))
    tok = torch.cat([vectors["flow.token"], extra], dim=1)  # 60 tokens
    full = flow.inference(tok, vectors["flow.prompt_token"], vectors["flow.prompt_feat"], vectors["flow.embedding"],
                          streaming=True, finalize=True)
    chunk = flow.inference(tok[:, :hop + 3], vectors["flow.prompt_token"], vectors["flow.prompt_feat"],
                           vectors["flow.embedding"], streaming=True, finalize=False)
    assert chunk.shape[2] == 2 * hop
    # frames of the first 50-frame-aligned block only depend on themselves and earlier frames
    assert (chunk - full[:, :, :2 * hop]).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------------------------------ checkpoints

def test_full_size_keys_equal_released_json():
    with open(os.path.join(GOLDEN, "full_size_state_dict_keys.json")) as f:
        ref = {k: tuple(v) for k, v in json.load(f)["flow"].items()}
    with torch.device("meta"):
        f = Flow(full_config().flow)
    shapes = f.checkpoint_shapes()
    assert shapes == ref
    assert list(shapes) == list(ref)  # same order too
    assert shapes["decoder.estimator.rotary_embed.inv_freq"] == (32,)


def test_checkpoint_missing_key(tiny_cfg, golden_sd):
    sd = dict(golden_sd)
    del sd["decoder.estimator.transformer_blocks.1.attn.to_k.bias"]
    with pytest.raises(CheckpointError, match=r"missing key 'decoder\.estimator\.transformer_blocks\.1\.attn\.to_k"):
        Flow(tiny_cfg).load_checkpoint(sd)


def test_checkpoint_unexpected_key(tiny_cfg, golden_sd):
    sd = dict(golden_sd)
    sd["decoder.estimator.long_skip_connection.weight"] = torch.zeros(128, 256)
    with pytest.raises(CheckpointError, match=r"unexpected key 'decoder\.estimator\.long_skip_connection\.weight'"):
        Flow(tiny_cfg).load_checkpoint(sd)


def test_checkpoint_misshaped_key(tiny_cfg, golden_sd):
    sd = dict(golden_sd)
    sd["pre_lookahead_layer.conv1.weight"] = torch.zeros(128, 80, 3)
    with pytest.raises(CheckpointError, match=r"'pre_lookahead_layer\.conv1\.weight' has shape \(128, 80, 3\)"):
        Flow(tiny_cfg).load_checkpoint(sd)


def test_checkpoint_missing_file(tiny_cfg, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        Flow(tiny_cfg).load_checkpoint(str(tmp_path / "nope.pt"))


# --------------------------------------------------------------------------------------------- noise / inputs

def test_request_too_long(golden_flow, vectors):
    # golden noise has 108 frames; prompt 20 + 40 tokens -> 120 frames
    tok = torch.cat([vectors["flow.token"], vectors["flow.token"][:, :10]], dim=1)
    with pytest.raises(RequestTooLongError, match=r"needs 120 mel frames \(40 prompt \+ 80 output\).*only 108"):
        golden_flow.inference(tok, vectors["flow.prompt_token"], vectors["flow.prompt_feat"],
                              vectors["flow.embedding"], streaming=False, finalize=True)
    mu = torch.zeros(1, 80, 109)
    with pytest.raises(RequestTooLongError, match="109"):
        golden_flow.solve(mu, torch.ones(1, 1, 109), torch.zeros(1, 80), mu)


def test_set_noise_validates(tiny_cfg):
    f = Flow(tiny_cfg)
    with pytest.raises(InputError, match=r"\[1, 80, frames\]"):
        f.set_noise(torch.zeros(1, 79, 10))
    f.set_noise(torch.ones(80, 12))
    assert f.max_frames == 12 and f.rand_noise.shape == (1, 80, 12)


def test_bad_inputs(flow, vectors):
    tok, ptok, pfeat, emb = (vectors[k] for k in ("flow.token", "flow.prompt_token", "flow.prompt_feat",
                                                  "flow.embedding"))
    with pytest.raises(InputError, match="token ids"):
        flow.prepare_row(torch.tensor([1, 6561]), ptok[0], pfeat[0], emb[0], True)
    with pytest.raises(InputError, match="prompt_feat"):
        flow.prepare_row(tok[0], ptok[0], pfeat[0, :, :79], emb[0], True)
    with pytest.raises(InputError, match="embedding"):
        flow.prepare_row(tok[0], ptok[0], pfeat[0], emb[0, :100], True)
    with pytest.raises(InputError, match="look-ahead"):
        flow.prepare_row(torch.tensor([5, 6]), torch.tensor([], dtype=torch.long), torch.zeros(0, 80), emb[0], False)
    with pytest.raises(InputError, match="batch 1"):
        flow.inference(tok.expand(2, -1), ptok, pfeat, emb)


def test_prepare_row_shapes(flow, vectors):
    tok, ptok, pfeat, emb = (vectors[k][0] for k in ("flow.token", "flow.prompt_token", "flow.prompt_feat",
                                                     "flow.embedding"))
    row = flow.prepare_row(tok, ptok, pfeat, emb, finalize=False)
    assert row.frames == 2 * (20 + 30 - 3) and row.prompt_frames == 40
    assert row.mu.shape == (80, 94) and row.cond.shape == (80, 94) and row.spks.shape == (80,)
    assert torch.equal(row.cond[:, :40], pfeat.T) and row.cond[:, 40:].abs().sum() == 0


# ------------------------------------------------------------------------------------------------- batching

def _rows(vectors):
    ptok, pfeat, emb, tok = (vectors[k][0] for k in ("flow.prompt_token", "flow.prompt_feat", "flow.embedding",
                                                     "flow.token"))
    g = torch.Generator().manual_seed(7)
    tok2 = torch.randint(0, 6561, (43,), generator=g)
    emb2 = torch.randn(192, generator=g)
    return [
        FlowInput(tok, ptok, pfeat, emb, finalize=True),                       # 100 frames
        FlowInput(tok2, ptok[:7], pfeat[:14], emb2, finalize=False),           # 94 frames
        FlowInput(tok[:11], ptok[5:], pfeat[10:], emb2, finalize=True),         # 52 frames
    ]


@pytest.mark.parametrize("streaming", [False, True])
def test_ragged_batch_equals_rows_alone(flow, vectors, streaming):
    rows = _rows(vectors)
    batched = flow.inference_batch(rows, streaming=streaming)
    assert [m.shape[2] for m in batched] == [60, 80, 22]
    for r, mel in zip(rows, batched):
        alone = flow.inference(r.token[None], r.prompt_token[None], r.prompt_feat[None], r.embedding[None],
                               streaming=streaming, finalize=r.finalize)
        assert mel.shape == alone.shape
        err = (mel - alone).abs().max().item()
        assert err <= BATCH_TOL, f"streaming={streaming}: row err {err}"


def test_batch_of_two_with_bucket_padding_and_finalize_override(flow, vectors):
    rows = _rows(vectors)[1:]
    batched = flow.inference_batch(rows, streaming=True, finalize=[True, False], pad_to=128)
    for r, fin, mel in zip(rows, [True, False], batched):
        alone = flow.inference(r.token[None], r.prompt_token[None], r.prompt_feat[None], r.embedding[None],
                               streaming=True, finalize=fin)
        assert (mel - alone).abs().max().item() <= BATCH_TOL


def test_empty_padding_row_is_finite_and_harmless(flow, vectors):
    # bucket padding may add rows whose mask is all zero: no NaN, other rows unchanged
    row = flow.prepare_row(*(vectors[k][0] for k in ("flow.token", "flow.prompt_token", "flow.prompt_feat",
                                                     "flow.embedding")), finalize=True)
    mu, mask, spks, cond = flow.collate([row])
    pad = lambda z: torch.cat([z, torch.zeros_like(z)])  # noqa: E731
    for streaming in (False, True):
        one = flow.solve(mu, mask, spks, cond, streaming)
        two = flow.solve(pad(mu), pad(mask), pad(spks), pad(cond), streaming)
        assert torch.isfinite(two).all()
        assert (two[:1] - one).abs().max().item() <= BATCH_TOL


def test_custom_estimator_is_used(golden_flow, vectors):
    calls = []

    def estimator(x, mask, mu, t, spks, cond, streaming=False):
        calls.append((x.shape[0], streaming, float(t[0])))
        return golden_flow.estimator(x, mask, mu, t, spks, cond, streaming=streaming)

    mel = golden_flow.inference(vectors["flow.token"], vectors["flow.prompt_token"], vectors["flow.prompt_feat"],
                                vectors["flow.embedding"], streaming=True, finalize=False, estimator=estimator)
    assert (mel - vectors["flow.stream.mel"]).abs().max().item() <= FLOW_TOL
    assert len(calls) == 10 and all(b == 2 and s for b, s, _ in calls)
    assert calls[0][2] == 0.0 and abs(calls[-1][2] - (1 - torch.cos(torch.tensor(0.45 * torch.pi)).item())) < 1e-6


# ------------------------------------------------------------------------------------------------------ masks

def test_attention_mask_semantics():
    mask = torch.tensor([[[1.0] * 120], [[1.0] * 70 + [0.0] * 50]])
    off = attention_mask(mask, streaming=False, chunk_size=50)
    st = attention_mask(mask, streaming=True, chunk_size=50)
    assert off.shape == st.shape == (2, 1, 120, 120)
    assert off[0].all() and off[1, 0, :, :70].all() and not off[1, 0, :, 70:].any()
    # streaming: query 49 sees keys < 50, query 50 sees keys < 100, query 119 sees all valid
    assert st[0, 0, 49, :50].all() and not st[0, 0, 49, 50:].any()
    assert st[0, 0, 50, :100].all() and not st[0, 0, 50, 100:].any()
    assert st[1, 0, 119, :70].all() and not st[1, 0, 119, 70:].any()
    empty = attention_mask(torch.zeros(1, 1, 5), streaming=True, chunk_size=2)
    assert empty.all()  # no all-False rows: SDPA stays finite


def test_half_precision_keeps_rope_float32(tiny_cfg):
    f = Flow(tiny_cfg).to(torch.float16)
    assert f.estimator.rotary_embed.inv_freq.dtype == torch.float32
    assert f.estimator.proj_out.weight.dtype == torch.float16
    assert f.rand_noise.dtype == torch.float16


@pytest.mark.parametrize("conv, sdpa", [("unfold", ""), ("nhwc", ""), ("triton", ""), ("cudnn", "efficient"),
                                        ("cudnn", "no_cudnn"),
                                        ("auto", "")])
def test_dit_conv_and_attention_choices_compute_the_same(flow, monkeypatch, conv, sdpa):
    """COSYTRT_DIT_CONV / COSYTRT_DIT_SDPA (runtime/models/dit_conv.py, for GPU A/B runs) change how the DiT's grouped
    convolutions and attention run, not what they compute: streaming and offline velocity equal the default's."""
    from cosytrt.runtime.models import dit_conv

    g = torch.Generator().manual_seed(3)
    c = flow.estimator.cfg
    T = 130
    args = (torch.randn(2, c.mel_dim, T, generator=g), torch.ones(2, 1, T), torch.randn(2, c.mu_dim, T, generator=g),
            torch.rand(2, generator=g), torch.randn(2, c.spk_dim, generator=g), torch.randn(2, c.mel_dim, T, generator=g))
    with torch.inference_mode():
        ref = [flow.estimator(*args, streaming=s) for s in (False, True)]
        monkeypatch.setattr(dit_conv, "CONV", conv)
        monkeypatch.setattr(dit_conv, "SDPA", sdpa)
        got = [flow.estimator(*args, streaming=s) for s in (False, True)]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("folded", [False, True])
def test_dit_conv_under_torch_compile(monkeypatch, folded):
    """Under torch.compile an explicit conv choice runs as the opaque op (the implementation as it runs eagerly, its
    output contiguous as the op's fake says) — the Triton conv's included, whose weight cache and launch Dynamo
    cannot trace (run 66; the kernel itself runs here where Triton's interpreter does: 16 channels per group); the
    default (auto) is the opaque op only where Dynamo does not fold `torch.compiler.is_exporting()` to True inside
    the trace — the device's torch 2.11 does (simulated here), and there the default traces `pick`'s F.conv1d, as in
    every measured run. torch.export (strict or not) never sees the op."""
    from cosytrt.runtime.models import dit, dit_conv

    if folded:
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    conv = torch.nn.Conv1d(64, 64, 31, groups=4)
    x = torch.randn(2, 64, 80)
    ref = F.conv1d(x, conv.weight, conv.bias, groups=4)
    for choice, opaque in (("unfold", True), ("triton", True), ("auto", not folded)):
        monkeypatch.setattr(dit_conv, "CONV", choice)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(str(gm.graph))
            return gm

        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(lambda t: dit._conv1d(conv, t), backend=backend, fullgraph=True, dynamic=True)(x)
        torch._dynamo.reset()
        assert ("dit_conv1d" in graphs[0]) == opaque, (choice, folded)
        assert got.is_contiguous()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        for strict in (False, True):
            with torch.no_grad():
                text = str(torch.export.export(_ConvModule(conv), (x,), strict=strict).graph)
            assert "dit_conv1d" not in text, (choice, strict)
            assert choice == "unfold" or "conv1d" in text, (choice, strict)  # unfold exports its matmul


class _ConvModule(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, t):
        from cosytrt.runtime.models import dit

        return dit._conv1d(self.conv, t)


def test_dit_conv_default_is_channels_last_conv2d_on_cuda_only(monkeypatch):
    """The default (`auto`) runs the grouped convolutions as channels-last conv2d on CUDA tensors (cuDNN's F.conv1d
    picked a 10x slower FFT algorithm in fp32 at some lengths on the H200) and as F.conv1d elsewhere; an explicit
    COSYTRT_DIT_CONV wins on every device."""
    from types import SimpleNamespace

    from cosytrt.runtime.models import dit_conv

    monkeypatch.setattr(dit_conv, "CONV", "auto")
    assert dit_conv.pick(torch.zeros(1)) is dit_conv.conv1d
    assert dit_conv.pick(SimpleNamespace(is_cuda=True)) is dit_conv.conv2d_nhwc
    monkeypatch.setattr(dit_conv, "CONV", "unfold")
    assert dit_conv.pick(SimpleNamespace(is_cuda=True)) is dit_conv.unfold_matmul
    assert dit_conv.pick(torch.zeros(1)) is dit_conv.unfold_matmul


def test_bucketed_dit_splits_a_call_over_buckets_and_matches_eager(flow):
    """A DiT call no single bucket takes within the padding-waste limit (6 rows of 40 frames, buckets b2/b4/b8 x
    t48: b8 would waste 1.6x) runs as b4 + b2 bucket calls (BucketTable.plan), not eagerly, and gives the eager
    model's velocity row for row; the shape stats count two hits, no fallback, two split parts."""
    from types import SimpleNamespace

    from cosytrt.engines.buckets import Bucket, BucketTable
    from cosytrt.runtime.models.dit import FixedModeDiT
    from cosytrt.runtime.stages.bucketed import BucketedDiT

    dit = flow.estimator
    names = ("x", "mask", "mu", "t", "spks", "cond")
    seen = []

    def run(inputs, bucket):  # an "engine": the eager model on the padded bucket shapes
        assert tuple(inputs["x"].shape[::2]) == (bucket.batch, bucket.length)
        seen.append(bucket.key)
        return {"out": FixedModeDiT(dit, False)(*(inputs[k] for k in names))}

    runner = SimpleNamespace(run=run, output_names=["out"], dtype=torch.float32)
    table = BucketTable([Bucket("dit", "offline", b, 48) for b in (2, 4, 8)])
    bd = BucketedDiT(dit, {"offline": runner}, {"offline": table})
    g = torch.Generator().manual_seed(5)
    c = dit.cfg
    b, T = 6, 40
    mask = torch.ones(b, 1, T)
    mask[1, :, 30:] = 0
    args = (torch.randn(b, c.mel_dim, T, generator=g), mask, torch.randn(b, c.mu_dim, T, generator=g),
            torch.rand(b, generator=g), torch.randn(b, c.spk_dim, generator=g), torch.randn(b, c.mel_dim, T, generator=g))
    with torch.inference_mode():
        ref = dit(*args, streaming=False)
        got = bd(*args, streaming=False)
    assert seen == ["dit/offline/b4xt48", "dit/offline/b2xt48"]
    valid = mask.expand_as(ref).bool()
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-5, atol=1e-5)
    st = bd.stats.summary()["stages"]["dit/offline"]
    assert (st["calls"], st["hits"], st["fallbacks"], st["split_parts"]) == (2, 2, 0, 2)
