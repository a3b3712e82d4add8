"""Batch invariance (issue #20): with `SchedulerConfig.batch_invariant` (the LM's batch-invariant kernels,
runtime/models/batch_invariant.py) a request's LM logits, hence its tokens, do not depend on the other requests in
its prefill / decode call, nor on the padded batch bucket or KV-length rung; its audio then matches the request run
alone within AUDIO_ATOL (DiT / HiFT batching). CPU, tiny model."""
from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

# before Triton is first imported (the skip mark below imports it): its interpreter runs the split-KV kernels on CPU
# tensors only when the variable is set then (as tests/test_decode_attention_triton.py does)
os.environ.setdefault("TRITON_INTERPRET", "1")

from cosytrt.runtime.stages import ar_graphs  # noqa: E402
from cosytrt.runtime.stages.ar_graphs import DecodeGraphs, PrefillGraphs  # noqa: E402
from cosytrt.runtime.models import batch_invariant as bi  # noqa: E402
from cosytrt.runtime.stages.request import prepare_inputs  # noqa: E402
from cosytrt.runtime.models.sampling import SamplingParams, TokenPolicy, generate  # noqa: E402
from cosytrt.runtime.tts import make_request  # noqa: E402
from graph_stand_in import DirectCall  # noqa: E402

ROWS = 16
# DiT / HiFT rows batched together are not bit-identical to the row alone (their GEMMs, convolutions and attention
# run at the batch's shape): same tokens, waveform within the golden HiFT tolerance (tests/test_scheduler.py).
AUDIO_ATOL = 2e-3
TEXTS = ["Hello there.", "Another one here!", "Third text, sampled freely.", "Fourth, streaming and sampled.",
         "Fifth one, offline.", "Sixth and last.", "Number seven is short.", "Eight.", "Nine is a longer sentence.",
         "Ten, ten, ten.", "Eleven speaks.", "Twelve: a colon.", "Thirteen?", "Fourteen, streaming.",
         "Sentence number 15 for the concurrency test.", "Sixteen and done."]


@pytest.fixture
def lm(golden_lm, one_torch_thread):
    golden_lm.setup_cache(ROWS + 1, 1025)  # 16 slots + a scratch slot 16
    golden_lm.batch_invariant = True
    yield golden_lm
    golden_lm.batch_invariant = False


def _inputs(hidden: int):
    g = torch.Generator().manual_seed(0)
    lengths = [9 + 5 * i for i in range(ROWS)]  # ragged: 9 .. 84
    return [torch.randn(n, hidden, generator=g) for n in lengths]


def _prefill(lm, embeds: list[torch.Tensor], slots: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(e.shape[0] for e in embeds)
    x = torch.zeros(len(embeds), width, embeds[0].shape[1])
    for i, e in enumerate(embeds):
        x[i, :e.shape[0]] = e
    return lm.prefill(x, torch.tensor([e.shape[0] for e in embeds]), torch.tensor(slots))


def _decode(lm, rows: list[int], embeds, kv_len: int) -> torch.Tensor:
    return lm.decode(torch.tensor([(37 * r) % 500 for r in rows]), torch.tensor(rows),
                     torch.tensor([embeds[r].shape[0] for r in rows]), kv_len=kv_len)


def _variations(lm) -> dict[str, float]:
    """Max |logit difference| of row 5 alone vs beside the 15 others vs in wider / longer padded calls."""
    embeds = _inputs(lm.config.qwen.hidden_size)
    out = {}
    with torch.inference_mode():
        alone = _prefill(lm, [embeds[5]], [5])[0]
        out["prefill beside 15 rows"] = (_prefill(lm, embeds, list(range(ROWS)))[5] - alone).abs().max().item()
        out["prefill padded to 512"] = (_prefill(lm, [embeds[5]], [5], 512)[0] - alone).abs().max().item()
        _prefill(lm, embeds, list(range(ROWS)))  # every slot holds its prompt
        alone = _decode(lm, [5], embeds, 256)[0]
        out["decode beside 15 rows"] = (_decode(lm, list(range(ROWS)), embeds, 256)[5] - alone).abs().max().item()
        for kv in (128, 512, 1024):
            out[f"decode at KV length {kv}"] = (_decode(lm, [5], embeds, kv)[0] - alone).abs().max().item()
    return out


def test_logits_bit_identical_alone_beside_15_rows_and_padded(lm):
    diffs = _variations(lm)
    assert all(d == 0.0 for d in diffs.values()), diffs


@pytest.mark.skipif(not bi._split_kv.available(), reason="Triton is not installed (the CPU torch wheel does not "
                    "bring it): the split-KV kernels run on a GPU machine or through Triton's interpreter")
def test_decode_through_split_kv_kernels_is_invariant_too(lm, monkeypatch):
    """The decode steps' split-KV attention (`batch_invariant.DECODE_ATTENTION`, "auto" = on CUDA; forced here and
    run through Triton's interpreter, reading each row's K / V in place from its slot where the rows are not the
    slots): a row's logits bit-identical alone, beside 15 rows and at every KV rung, and within rounding of the
    batch-invariant attention's."""
    monkeypatch.setattr(bi, "DECODE_ATTENTION", "split_kv")
    calls = []
    for name in ("split_kv_decode_attention", "split_kv_decode_attention_slots"):
        real = getattr(bi._split_kv, name)
        monkeypatch.setattr(bi._split_kv, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    diffs = _variations(lm)
    assert "split_kv_decode_attention_slots" in calls and all(d == 0.0 for d in diffs.values()), diffs
    embeds = _inputs(lm.config.qwen.hidden_size)
    with torch.inference_mode():
        _prefill(lm, embeds, list(range(ROWS)))
        split = _decode(lm, list(range(ROWS)), embeds, 256)
        monkeypatch.setattr(bi, "DECODE_ATTENTION", "bi")
        n = len(calls)
        plain = _decode(lm, list(range(ROWS)), embeds, 256)
        assert len(calls) == n  # "bi": the split-KV kernels not called
    torch.testing.assert_close(split, plain, rtol=1e-4, atol=1e-4)


def test_decode_attention_auto_keeps_cpu_on_the_bi_op(monkeypatch):
    """"auto" sends only CUDA tensors to the split-KV kernels: on CPU the decode attention is `attention`'s."""
    monkeypatch.setattr(bi, "DECODE_ATTENTION", "auto")
    for name in ("split_kv_decode_attention", "split_kv_decode_attention_slots"):
        monkeypatch.setattr(bi._split_kv, name, lambda *a: pytest.fail("split-KV on CPU"))
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 1, 7, 16, generator=g)
    cache = SimpleNamespace(k=torch.randn(3, 2, 320, 16, generator=g), v=torch.randn(3, 2, 320, 16, generator=g))
    pos = torch.tensor([[10], [299]])
    for slots in (None, torch.tensor([2, 0])):  # rows 0..1 of the cache, or slots 2 and 0
        k, v = (c[:2, :, :300] if slots is None else c[slots, :, :300] for c in (cache.k, cache.v))
        torch.testing.assert_close(bi.decode_attention(q, cache, slots, 300, pos, pos[:, 0] + 1, 256),
                                   bi.attention(q, k, v, pos, pos[:, 0] + 1, 256), rtol=0, atol=0)


def test_plain_kernels_are_not_batch_invariant(lm):
    """The check above has teeth: the plain kernels give a row different last bits beside other rows (MKL runs a
    one-row GEMM as a GEMV). Skipped where this CPU's kernels happen to agree."""
    lm.batch_invariant = False
    diffs = _variations(lm)
    if all(d == 0.0 for d in diffs.values()):
        pytest.skip("the plain kernels happen to be batch-invariant on this CPU")
    assert max(diffs.values()) < 1e-4  # last bits only


def test_kernels_tile_position_and_neighbours():
    """A row's linear / norm / attention output does not depend on its neighbours or its place in the tile."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(40, 64, generator=g)
    ref_lin = bi.linear(x[:1], w, b, 32)[0]
    ref_norm = bi.rms_norm(x[:1], b[:64], 1e-6, 32)[0]
    for pos in (0, 1, 17, 31, 32, 39):
        y = torch.randn(40, 64, generator=g)
        y[pos] = x[0]
        assert torch.equal(bi.linear(y, w, b, 32)[pos], ref_lin)
        assert torch.equal(bi.rms_norm(y, b[:64], 1e-6, 32)[pos], ref_norm)
    q, k, v = (torch.randn(3, 2, 1, 2, 16, generator=g), torch.randn(3, 2, 700, 16, generator=g),
               torch.randn(3, 2, 700, 16, generator=g))
    pos = torch.tensor([[5], [300], [650]])
    full = bi.attention(q, k, v, pos, pos[:, 0] + 1, 256)
    for r in range(3):
        n = int(pos[r, 0]) + 1
        for cut in sorted({n, -(-n // 256) * 256, 700}):  # the row's own length, its block, the whole cache
            one = bi.attention(q[r:r + 1], k[r:r + 1, :, :cut], v[r:r + 1, :, :cut], pos[r:r + 1], pos[r, :1] + 1, 256)
            assert torch.equal(one[0], full[r])




def _graph_tokens(lm, lm_input, text_len, params, prefill_key, batch, rung_of) -> list[int]:
    """`generate` with the prefill run in the (rows, length) prefill graph `prefill_key` and every decode step in
    the decode graph of `batch` rows (padding rows in the scratch slot) at KV rung `rung_of(need)`."""
    hidden, scratch = lm.config.qwen.hidden_size, ROWS
    pg = PrefillGraphs(lm.prefill, [prefill_key[0]], [prefill_key[1]], 4096, hidden, torch.float32, scratch, "cpu")
    rungs = [256, 512, 1024]
    dg = DecodeGraphs(lm.decode, [batch], rungs, scratch, "cpu")
    policy = TokenPolicy(text_len, params, lm.config.speech_token_size)
    slot, pos = torch.tensor([3]), lm_input.shape[0]
    with torch.inference_mode():
        logits = pg(lm_input[None], torch.tensor([pos]), slot)[0]
        tok, done = policy.step(logits)
        while not done:
            need = rung_of(pos + 1)
            logits = dg(torch.tensor([policy.next_input]), slot, torch.tensor([pos]), need)[0]
            pos += 1
            tok, done = policy.step(logits)
    return policy.output


@pytest.fixture(scope="module")
def bi_tts():
    """A tiny TTS whose scheduler runs the batch-invariant LM (the switch is off by default)."""
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.tts import TTS

    t = TTS.load("tiny", scheduler=SchedulerConfig(batch_invariant=True))
    yield t
    t.close()


def test_tokens_same_in_every_ar_graph_bucket(lm, bi_tts, monkeypatch):
    monkeypatch.setattr(ar_graphs, "GraphCache", DirectCall)
    p = bi_tts.pipeline
    req = make_request("Sentence number 15 for the concurrency test.", seed=115)
    inputs = prepare_inputs(p.frontend, req, p.default_speaker)
    lm_input = lm.build_lm_input(inputs.text_ids, inputs.prompt_speech_tokens).float()
    params = SamplingParams(seed=115, max_tokens=30)
    lm.setup_cache(ROWS + 1, 1025)
    with torch.inference_mode():
        ref = list(generate(lm, lm_input, inputs.text_len, params))
    lm.setup_cache(ROWS + 1, 1025)
    assert len(ref) > 5
    n = lm_input.shape[0]
    smallest, largest = (lambda need: need), (lambda need: 1024)  # KV rung: the smallest that holds it, the largest
    for key, batch, rung_of in [((1, n), 1, smallest), ((2, 256), 4, largest), ((8, 512), 16, smallest)]:
        got = _graph_tokens(lm, lm_input, inputs.text_len, params, key, batch, rung_of)
        assert got == ref, f"prefill bucket {key}, decode batch {batch}"


# ------------------------------------------------------------------------------ library and server, 16 requests

def _specs():
    return [dict(text=t, seed=100 + i, stream=i % 3 == 0, max_tokens=30 + i) for i, t in enumerate(TEXTS)]


def _threads(fn, n):
    out = [None] * n

    def go(i):
        out[i] = fn(i)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _run(tts, spec):
    h = tts.submit(spec["text"], stream=spec["stream"], seed=spec["seed"], max_tokens=spec["max_tokens"])
    return np.concatenate(list(h.chunks(timeout=300))), h


def test_16_concurrent_requests_match_each_alone_library(bi_tts, one_torch_thread):
    tts = bi_tts
    assert tts.scheduler_config.batch_invariant
    specs = _specs()
    alone = [_run(tts, s) for s in specs]
    before = tts.scheduler.stats()
    together = _threads(lambda i: _run(tts, specs[i]), len(specs))
    st = tts.scheduler.stats()
    assert st["ar"]["max_decode_batch"] >= 8 and st["ar"]["batched_decode_steps"] > before["ar"]["batched_decode_steps"]
    for s, (wa, ha), (wb, hb) in zip(specs, alone, together):
        assert hb.tokens == ha.tokens, f"{s['text']!r} seed {s['seed']}: tokens differ beside 15 other requests"
        assert wa.shape == wb.shape
        assert np.abs(wa - wb).max() <= AUDIO_ATOL, s
    print("audio max |diff| beside 15 requests:", max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(alone, together)))


def test_16_concurrent_requests_match_each_alone_server(bi_tts, tmp_path, one_torch_thread):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from cosytrt.runtime.serving.app import ServerSettings, create_app

    app = create_app(bi_tts, ServerSettings(voices_dir=str(tmp_path / "voices"), max_in_flight=16, warmup=False,
                                              allowed_hosts=["testserver"]))
    specs = _specs()

    def post(c, s):
        r = c.post("/v1/audio/speech", json={"model": "cosyvoice3", "input": s["text"], "voice": "default",
                                             "seed": s["seed"], "max_tokens": s["max_tokens"],
                                             "response_format": "pcm"})
        assert r.status_code == 200, r.text
        return int(r.headers["x-speech-tokens"]), np.frombuffer(r.content, dtype=np.int16).astype(np.float32)

    with TestClient(app) as c:
        alone = [post(c, s) for s in specs]
        together = _threads(lambda i: post(c, specs[i]), len(specs))
    for s, (na, wa), (nb, wb) in zip(specs, alone, together):
        assert na == nb and wa.shape == wb.shape, f"{s['text']!r} seed {s['seed']}: {na} tokens alone, {nb} beside 15"
        assert np.abs(wa - wb).max() <= AUDIO_ATOL * 32768 + 1, s  # 16-bit PCM: the bound plus one rounding step


def test_runner_self_check_at_start(golden_lm, one_torch_thread, caplog):
    """TorchARRunner.check_batch_invariance (run by make_ar_runner with SchedulerConfig.batch_invariant): with the
    switch on, a row's decode logits are the same alone and as one of 16 rows, and stats() says so; with the plain
    kernels the same check finds the difference on this CPU and warns (skipped where they happen to agree)."""
    import logging

    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.scheduling.scheduler import make_ar_runner
    from cosytrt.runtime.stages.ar_runner import TorchARRunner

    models = SimpleNamespace(llm=golden_lm)
    try:
        runner = make_ar_runner(models, SchedulerConfig(batch_invariant=True, ar_max_batch=16, ar_max_len=256),
                                "cpu")
        check = runner.stats()["batch_invariance_check"]
        assert check["checked"] and check["invariant"] and check["rows"] == 16, check
        assert runner.free == 16  # its slot went back
        golden_lm.batch_invariant = False
        plain = TorchARRunner(golden_lm, 16, 256, "cpu")
        with caplog.at_level(logging.WARNING):
            result = plain.check_batch_invariance()
        if result["invariant"]:
            pytest.skip("the plain kernels happen to be batch-invariant on this CPU")
        assert result["max_abs_diff"] > 0 and "tokens may depend on the batch" in caplog.text
    finally:
        golden_lm.batch_invariant = False
