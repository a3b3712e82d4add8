"""The split-KV decode attention (runtime/models/decode_attention_triton.py, `CosyVoice3LM.decode_attention_impl =
"split_kv"`): its kernels run on CPU through Triton's interpreter (skipped where Triton is not installed: the CPU
torch wheel does not bring it, so CI checks the torch reference and the LM wiring only). Same values as the masked
softmax (fp32 rounding: online vs two-pass softmax), a row's bits the same alone, beside other rows and at a longer
KV rung; the tiny LM's decode logits with the op equal the SDPA ones; torch.compile keeps the op opaque. fp32 only:
bf16 through Triton's interpreter is not representative (its emulation returned values ~8e8 off for this kernel,
before and after session 23's change alike, while fp16 / fp32 agree to 1e-4 / 2e-7); bf16 values were checked on an
H100 (BENCHMARKS run 62: within 1.5-8e-3 of the fp32 reference)."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first defined (on first use)

from cosytrt.engines.errors import InputError  # noqa: E402
from cosytrt.runtime.models import decode_attention_triton as dat  # noqa: E402
from cosytrt.runtime.models.config import tiny_config  # noqa: E402
from cosytrt.runtime.models.llm import decode_attention  # noqa: E402
from cosytrt.runtime.models.loading import build_modules  # noqa: E402

needs_triton = pytest.mark.skipif(not dat.available(), reason="Triton is not installed (the CPU torch wheel does "
                                  "not bring it): the kernels run on a GPU machine or through the interpreter")
KVH, G, HD = 2, 7, 16


def _case(b, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, KVH, G, HD, generator=g), torch.randn(b, KVH, n, HD, generator=g),
            torch.randn(b, KVH, n, HD, generator=g))


def _masked_sdpa(q, k, v, positions):
    mask = (torch.arange(k.shape[2])[None, :] <= positions[:, None])[:, None, None, :]
    return decode_attention(q, k, v, mask, reduce_max_rows=0)


def test_reference_equals_masked_sdpa():
    q, k, v = _case(3, 150)
    pos = torch.tensor([0, 63, 149])
    torch.testing.assert_close(dat.reference(q, k, v, pos), _masked_sdpa(q, k, v, pos), rtol=1e-5, atol=1e-5)


@needs_triton
def test_kernels_equal_masked_softmax_across_splits():
    q, k, v = _case(5, 150, seed=1)   # 3 splits of 64: rows ending inside the first, on a split edge, in the last
    pos = torch.tensor([0, 63, 64, 100, 149])
    out = dat.attention(q, k, v, pos)
    torch.testing.assert_close(out, _masked_sdpa(q, k, v, pos), rtol=1e-5, atol=1e-5)


@needs_triton
def test_a_position_past_the_view_attends_the_whole_view():
    """A position >= n (never made by the runner: its rungs cover every row) reads nothing past the view: the kernels
    attend all n keys, as the mask and the reference do."""
    q, k, v = _case(2, 100, seed=7)
    pos = torch.tensor([500, 40])
    out = dat.attention(q, k, v, pos)
    torch.testing.assert_close(out, dat.reference(q, k, v, pos), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[0], dat.attention(q[:1], k[:1], v[:1], torch.tensor([99]))[0], rtol=0, atol=0)


@needs_triton
def test_kernels_read_strided_cache_views():
    g = torch.Generator().manual_seed(2)
    cache_k = torch.randn(6, KVH, 256, HD, generator=g)   # [slots, kvh, max_len, hd]: the decode reads a view
    cache_v = torch.randn(6, KVH, 256, HD, generator=g)
    q = torch.randn(4, KVH, G, HD, generator=g)
    k, v = cache_k[:4, :, :130], cache_v[:4, :, :130]
    pos = torch.tensor([5, 129, 70, 64])
    torch.testing.assert_close(dat.attention(q, k, v, pos), dat.reference(q, k, v, pos), rtol=1e-5, atol=1e-5)


@needs_triton
def test_kernels_read_rows_in_place_from_the_slot_cache():
    """`rows` (the decode step's slots, any order, repeated): each query row reads its K / V in place from the whole
    cache — the same bits as gathering `cache[rows, :, :n]` first, for positions inside, on and past `n_keys`."""
    g = torch.Generator().manual_seed(8)
    cache_k = torch.randn(6, KVH, 256, HD, generator=g)
    cache_v = torch.randn(6, KVH, 256, HD, generator=g)
    q = torch.randn(5, KVH, G, HD, generator=g)
    rows = torch.tensor([4, 0, 4, 5, 2])
    pos = torch.tensor([5, 129, 64, 190, 300])
    n = 192
    got = dat.attention(q, cache_k, cache_v, pos, rows=rows, n_keys=n)
    want = dat.attention(q, cache_k[rows, :, :n], cache_v[rows, :, :n], pos)
    assert torch.equal(got, want)
    assert torch.equal(dat.split_kv_decode_attention_slots(q, cache_k, cache_v, rows, pos, n), got)
    with pytest.raises(ValueError, match="n_keys 300 outside 1..256"):
        dat.attention(q, cache_k, cache_v, pos, rows=rows, n_keys=300)


def test_slots_op_reference_equals_the_gathered_reference(monkeypatch):
    """Without the kernels (CI's CPU torch) the slot-cache op is the reference over the gathered rows."""
    monkeypatch.setattr(dat, "runs_on", lambda t: False)
    g = torch.Generator().manual_seed(9)
    cache_k, cache_v = torch.randn(4, KVH, 80, HD, generator=g), torch.randn(4, KVH, 80, HD, generator=g)
    q = torch.randn(3, KVH, G, HD, generator=g)
    slots, pos = torch.tensor([3, 1, 3]), torch.tensor([10, 63, 70])
    got = dat.split_kv_decode_attention_slots(q, cache_k, cache_v, slots, pos, 64)
    assert torch.equal(got, dat.reference(q, cache_k[slots, :, :64], cache_v[slots, :, :64], pos))


@needs_triton
def test_row_bits_do_not_depend_on_neighbours_or_rung():
    q, k, v = _case(6, 256, seed=3)
    pos = torch.tensor([10, 200, 99, 255, 64, 130])
    full = dat.attention(q, k, v, pos)
    alone = dat.attention(q[2:3], k[2:3, :, :128], v[2:3, :, :128], pos[2:3])   # a shorter rung, alone
    assert torch.equal(full[2], alone[0])
    pair = dat.attention(q[[2, 3]], k[[2, 3]], v[[2, 3]], pos[[2, 3]])
    assert torch.equal(pair[0], alone[0])


@needs_triton
def test_op_runs_the_kernels_under_the_interpreter(monkeypatch):
    q, k, v = _case(2, 70, seed=4)
    pos = torch.tensor([69, 3])
    assert torch.equal(dat.split_kv_decode_attention(q, k, v, pos), dat.attention(q, k, v, pos))


def _tiny_lm():
    torch.manual_seed(0)
    llm = build_modules(tiny_config())[0].eval()
    llm.setup_cache(4, 128)
    return llm


def _decode_logits(llm, impl, steps=3, slots=(0, 1, 2), decode=None):
    """Prefill 3 rows of different lengths into `slots`, then `steps` decode steps through `decode` (default
    `llm.decode`); the logits of each step."""
    llm.decode_attention_impl = impl
    decode = decode or llm.decode
    g = torch.Generator().manual_seed(5)
    h = llm.config.qwen.hidden_size
    lengths = [5, 17, 9]
    with torch.inference_mode():
        emb = torch.randn(3, max(lengths), h, generator=g)
        llm.prefill(emb, torch.tensor(lengths), torch.tensor(slots))
        out, pos = [], torch.tensor(lengths)
        for _ in range(steps):
            out.append(decode(torch.tensor([7, 8, 9]), torch.tensor(slots), pos, kv_len=64))
            pos = pos + 1
    return out


@pytest.mark.parametrize("slots", [(0, 1, 2), (3, 0, 2)])
@pytest.mark.parametrize("kernels", [False, True])
def test_lm_decode_with_split_kv_equals_sdpa(monkeypatch, kernels, slots):
    if kernels and not dat.available():
        pytest.skip("Triton is not installed: the torch reference path only")
    if not kernels:
        monkeypatch.setattr(dat, "runs_on", lambda t: False)
    llm = _tiny_lm()
    ref = _decode_logits(llm, "sdpa", slots=slots)
    llm = _tiny_lm()
    got = _decode_logits(llm, "split_kv", slots=slots)
    assert llm.decode_attention_impl == "split_kv"
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_attention_impl_names_bad_values():
    llm = _tiny_lm()
    with pytest.raises(InputError, match="decode_attention_impl must be one of sdpa, split_kv"):
        llm.decode_attention_impl = "flash"
    assert llm.decode_attention_impl == "sdpa"


def test_compile_keeps_the_op_opaque(monkeypatch):
    monkeypatch.setattr(dat, "runs_on", lambda t: False)
    q, k, v = _case(2, 40, seed=6)
    pos = torch.tensor([39, 12])
    fn = torch.compile(lambda q, k, v, p: dat.split_kv_decode_attention(q, k, v, p) * 2, backend="aot_eager",
                       fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, pos), dat.reference(q, k, v, pos) * 2)


def test_scheduler_config_names_a_bad_decode_attention():
    from cosytrt.runtime.scheduling.config import SchedulerConfig, config_overrides

    with pytest.raises(InputError, match="ar_decode_attention must be one of auto, sdpa, split_kv"):
        SchedulerConfig(ar_decode_attention="flash")
    assert config_overrides(["ar_decode_attention=split_kv"]) == {"ar_decode_attention": "split_kv"}


def test_scheduler_with_split_kv_gives_the_same_tokens_on_cpu(monkeypatch):
    """The tiny model through the scheduler with the split-KV op (torch reference on the CPU: the kernels' values
    are checked above) gives each request the tokens of the SDPA decode (the same seed)."""
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.tts import TTS

    monkeypatch.setattr(dat, "runs_on", lambda t: False)
    tokens = {}
    for impl in ("sdpa", "split_kv"):
        tts = TTS.load("tiny", scheduler=SchedulerConfig(ar_decode_attention=impl))
        try:
            hs = [tts.submit(text, seed=3) for text in ("hello there", "a longer sentence to speak")]
            for h in hs:
                h.result(timeout=120)
            tokens[impl] = [h.tokens for h in hs]
            assert all(tokens[impl])
            assert tts.pipeline.models.llm.decode_attention_impl == impl
        finally:
            tts.close()
    assert tokens["sdpa"] == tokens["split_kv"]


def test_auto_decode_attention_is_split_kv_on_cuda_with_triton_only(monkeypatch):
    """The default ("auto") resolves per device: sdpa on the CPU, split_kv on CUDA where Triton imports (run 63),
    sdpa there without Triton; an explicit choice is kept."""
    from cosytrt.runtime.scheduling.config import SchedulerConfig

    cfg = SchedulerConfig()
    assert cfg.ar_decode_attention == "auto"
    assert cfg.decode_attention_for("cpu") == "sdpa"
    monkeypatch.setattr(dat, "available", lambda: True)
    assert cfg.decode_attention_for("cuda") == "split_kv"
    assert SchedulerConfig(ar_decode_attention="sdpa").decode_attention_for("cuda") == "sdpa"
    monkeypatch.setattr(dat, "available", lambda: False)
    assert cfg.decode_attention_for("cuda") == "sdpa"
    assert SchedulerConfig(ar_decode_attention="split_kv").decode_attention_for("cpu") == "split_kv"


def test_compiled_decode_reads_the_slot_cache_in_place(monkeypatch):
    """The tiny LM's decode step with split_kv under torch.compile (Inductor, CPU; the op's torch reference inside):
    the same logits and KV cache as eager, the op reading the cache after the step's own K / V write, and no copy of
    the whole cache in Inductor's code (its index_put into the cache stays in place, the op takes the buffer)."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(dat, "runs_on", lambda t: False)
    slots = (3, 0, 2)
    eager = _tiny_lm()
    want = _decode_logits(eager, "split_kv", steps=1, slots=slots)[0]
    llm = _tiny_lm()
    fn, code = torch.compile(llm.decode, fullgraph=True), []

    def compiled(*args, **kw):
        out, src = run_and_get_code(fn, *args, **kw)
        code.extend(src)
        return out

    got = _decode_logits(llm, "split_kv", steps=1, slots=slots, decode=compiled)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for a, b in zip(llm.backbone.layers, eager.backbone.layers):
        torch.testing.assert_close(a.self_attn.kv_cache.k, b.self_attn.kv_cache.k, rtol=1e-4, atol=1e-4)
    shape = tuple(llm.backbone.layers[0].self_attn.kv_cache.k.shape)
    src = "\n".join(code)
    assert "split_kv_decode_attention_slots" in src
    allocs = [line for line in src.splitlines() if "empty_strided" in line and str(shape).replace(" ", "") in
              line.replace(" ", "")]
    assert not allocs, f"a copy of the whole KV cache per step: {allocs[:2]}"
