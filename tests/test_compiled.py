"""torch.compile of the AR prefill / decode step and the DiT (runtime/compiled.py), on the CPU with the tiny model:
same numbers as eager (Inductor's CPU kernels reorder float32 sums: <= 1e-4 here), one compile per function and
specialization, a scheduler that compiles at start-up, and a TTS whose audio matches the eager one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cosytrt.build.export_dit import example_inputs
from cosytrt.runtime.stages.compiled import CompiledDiT, compile_fn, load_compile_cache, save_compile_cache
from cosytrt.engines.errors import InputError
from cosytrt.runtime.scheduling.scheduler import Scheduler, SchedulerConfig
from cosytrt.runtime.tts import TTS

ATOL = 1e-4
BATCHED_ATOL = 2e-3  # golden HiFT wav tolerance (also what batched, i.e. differently summed, calls get)


@pytest.fixture(scope="module")
def compiled_tts():
    t = TTS.load("tiny", compile=True)
    yield t
    t.close()


def test_compiled_decode_and_prefill_match_eager(golden_lm):
    lm = golden_lm
    lm.setup_cache(4, 512)
    decode, prefill = compile_fn(lm.decode), compile_fn(lm.prefill)
    assert compile_fn(lm.decode) is decode  # one compiled function per model and method
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b, t in ((1, 9), (3, 17)):
            embeds = torch.randn(b, t, lm.config.qwen.hidden_size, generator=g)
            lengths = torch.tensor([t - i for i in range(b)])
            slots = torch.arange(b)
            ref = lm.prefill(embeds, lengths, slots)
            k_ref = lm.backbone.layers[0].self_attn.kv_cache.k.clone()
            out = prefill(embeds, lengths, slots)
            assert (out - ref).abs().max() <= ATOL
            assert (lm.backbone.layers[0].self_attn.kv_cache.k - k_ref).abs().max() <= ATOL
            for kv_len in (256, 512):  # a rung and the whole cache (a dynamo specialization)
                tokens, pos = torch.randint(0, 6561, (b,), generator=g), lengths.clone()
                ref = lm.decode(tokens, slots, pos, kv_len=kv_len)
                out = decode(tokens, slots, pos, kv_len=kv_len)
                assert (out - ref).abs().max() <= ATOL


@pytest.mark.parametrize("streaming", [False, True])
def test_compiled_dit_matches_eager(streaming, tiny_tts):
    dit = tiny_tts.pipeline.models.flow.estimator
    import torch._dynamo.utils as dynamo_utils

    compiled = CompiledDiT.of(dit)
    assert CompiledDiT.of(dit) is compiled
    graphs = lambda: dynamo_utils.counters["stats"]["unique_graphs"]  # noqa: E731
    with torch.inference_mode():
        before = None
        # three shapes, one compile per mode: dynamic B and T, and the convolutions are opaque to the compiler, so
        # no guard on the batch size (the framework's conv shape rule guards on batch >= 16)
        for b, t in ((2, 60), (4, 97), (16, 40)):
            args = example_inputs(dit, b, t, seed=b)
            ref = dit(*args, streaming=streaming)
            assert (compiled(*args, streaming=streaming) - ref).abs().max() <= ATOL
            assert (compiled.fixed(streaming)(*args) - ref).abs().max() <= ATOL
            before = graphs() if before is None else before
        assert graphs() == before


def test_regional_compiled_dit_matches_eager(tiny_tts, monkeypatch):
    """Regional compilation (`set_compile_scope("regional")`): the transformer block compiled once and reused by
    every block, mode and length; the DiT equals the eager one in both attention modes at three shapes."""
    import torch._dynamo.utils as dynamo_utils

    from cosytrt.runtime.stages.compiled import compile_scope, set_compile_scope

    dit = tiny_tts.pipeline.models.flow.estimator
    reg = CompiledDiT.of(dit, "regional")
    assert reg is CompiledDiT.of(dit, "regional") and reg is not CompiledDiT.of(dit, "whole") and reg.scope == "regional"
    dynamo_utils.counters.clear()
    with torch.inference_mode():
        for streaming in (False, True):
            for b, t in ((2, 60), (4, 97), (16, 40)):
                args = example_inputs(dit, b, t, seed=b)
                ref = dit(*args, streaming=streaming)
                assert (reg(*args, streaming=streaming) - ref).abs().max() <= ATOL
                assert (reg.fixed(streaming)(*args) - ref).abs().max() <= ATOL
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, "one block graph for all blocks, modes and shapes"
    # the scope: argument, else set_compile_scope, else $COSYTRT_COMPILE_SCOPE, else whole
    try:
        monkeypatch.delenv("COSYTRT_COMPILE_SCOPE", raising=False)
        assert compile_scope() == "whole"
        monkeypatch.setenv("COSYTRT_COMPILE_SCOPE", "regional")
        assert compile_scope() == "regional" and CompiledDiT.of(dit) is reg
        set_compile_scope("whole")
        assert compile_scope() == "whole"
        with pytest.raises(InputError, match="compile scope must be one of whole, regional"):
            set_compile_scope("layers")
        with pytest.raises(InputError, match="compile scope must be one of"):
            CompiledDiT.of(dit, "layers")
        set_compile_scope(None)
        monkeypatch.setenv("COSYTRT_COMPILE_SCOPE", "nope")
        with pytest.raises(InputError, match="COSYTRT_COMPILE_SCOPE"):
            compile_scope()
        monkeypatch.delenv("COSYTRT_COMPILE_SCOPE")
        with pytest.raises(InputError, match="compile scope must be one of"):  # before any model work
            TTS.load("tiny", compile="layers")
    finally:
        set_compile_scope(None)
    from cosytrt.runtime.serving.settings import ServerSettings

    assert ServerSettings(compile=True, compile_scope="regional").compile_scope == "regional"
    with pytest.raises(InputError, match="compile_scope needs compile"):
        ServerSettings(compile_scope="regional")
    with pytest.raises(InputError, match="compile_scope must be"):
        ServerSettings(compile=True, compile_scope="blocks")


def test_regional_compiled_lm_matches_eager(golden_lm):
    """The LM in the regional scope (`compiled_lm(lm, "regional")`: the decoder layer compiled once for all layers):
    prefill and decode steps equal eager (logits and the KV written) at several shapes, with few graphs."""
    import torch._dynamo.utils as dynamo_utils

    from cosytrt.runtime.stages.compiled import compiled_lm

    lm = golden_lm
    lm.setup_cache(4, 512)
    decode, prefill = compiled_lm(lm, "regional")
    dynamo_utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for b, t in ((2, 9), (3, 17), (4, 30)):
            embeds = torch.randn(b, t, lm.config.qwen.hidden_size, generator=g)
            lengths = torch.tensor([t - i for i in range(b)])
            slots = torch.arange(b)
            ref = lm.prefill(embeds, lengths, slots)
            k_ref = lm.backbone.layers[-1].self_attn.kv_cache.k.clone()
            assert (prefill(embeds, lengths, slots) - ref).abs().max() <= ATOL
            assert (lm.backbone.layers[-1].self_attn.kv_cache.k - k_ref).abs().max() <= ATOL
            tokens = torch.randint(0, 100, (b,), generator=g)
            ref = lm.decode(tokens, slots, lengths, kv_len=64)
            assert (decode(tokens, slots, lengths, kv_len=64) - ref).abs().max() <= ATOL
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 4, f"{graphs} layer graphs for prefill and decode at three shapes"


def test_scheduler_compiles_once_at_start():
    """A compiled scheduler compiles one prefill graph at start; the decode step compiles once for <= 2 rows (the
    reduce-form attention) and once for more rows (SDPA); with `batch_invariant` (the default) the decode step has one
    code path for every batch, so it compiles once. Batch-1 calls get a padding row and the longest KV rung is a
    strict slice of the cache, so serving batches of 1..3 rows up to the longest rung compiles nothing else."""
    import torch._dynamo.utils as dynamo_utils

    from cosytrt.runtime.stages.pipeline import Pipeline
    from cosytrt.runtime.tts import make_request

    pipeline = Pipeline.load("tiny")  # fresh modules: nothing compiled for them yet
    graphs = lambda: dynamo_utils.counters["stats"]["unique_graphs"]  # noqa: E731
    before = graphs()
    sched = Scheduler(pipeline, SchedulerConfig(compile=True, ar_max_batch=4, ar_max_len=512))
    expected = 2 if sched.config.batch_invariant else 3
    try:
        assert graphs() - before == expected  # prefill + decode at 2 rows (and at 3 without batch_invariant)
        solo = sched.submit(make_request("Alone.", seed=0, force_tokens=20))
        solo.result(timeout=120)
        hs = [sched.submit(make_request(f"Text {i}.", seed=i, force_tokens=n)) for i, n in enumerate((20, 30, 300))]
        for h in hs:
            h.result(timeout=300)
        assert graphs() - before == expected  # serving compiled nothing more
        assert sched.stats()["compiles_since_start"] == 0
        st = sched.stats()["ar"]
        assert st["max_decode_batch"] == 3 and st["prefill_calls"] >= 2
        assert max(len(h.tokens) for h in hs) == 300  # reached past 256 positions: the longest rung (512)
    finally:
        sched.close()


def test_compiled_tts_matches_eager(tiny_tts, compiled_tts):
    for kw in (dict(seed=3, force_tokens=60), dict(seed=4, force_tokens=45)):
        ref = tiny_tts.synthesize("Compiled or not.", **kw)
        out = compiled_tts.synthesize("Compiled or not.", **kw)
        assert out.shape == ref.shape and np.abs(out - ref).max() <= BATCHED_ATOL
        ref = np.concatenate(list(tiny_tts.stream("Compiled or not.", **kw)))
        out = np.concatenate(list(compiled_tts.stream("Compiled or not.", **kw)))
        assert out.shape == ref.shape and np.abs(out - ref).max() <= BATCHED_ATOL
    assert compiled_tts.scheduler.config.compile and not tiny_tts.scheduler.config.compile


def test_compile_cache_file(tmp_path):
    """TTS.load(compile=True, compile_cache=FILE) compiles at load, with a warm-up that metrics() leaves out, and
    writes the artifacts to FILE, which load_compile_cache takes back; a cache without compile, or a missing file,
    is a named error."""
    import os

    path = str(tmp_path / "cache.bin")
    with TTS.load("tiny", compile=True, compile_cache=path) as tts:
        assert tts.metrics()["requests"] == 0 and tts.scheduler.stats()["completed"] == 2
    assert os.path.getsize(path) > 0 and load_compile_cache(path)
    assert save_compile_cache(str(tmp_path / "again.bin")) > 0
    with pytest.raises(InputError, match="compile cache not found"):
        load_compile_cache(str(tmp_path / "missing.bin"))
    with pytest.raises(InputError, match="compile_cache needs compile=True"):
        TTS.load("tiny", compile_cache=path)


def test_graph_static_inputs_match_the_workers_calls():
    """CUDA-graph buffers are inference tensors, like the workers' own inputs: the compiled DiT captured from them
    then runs an uncaptured shape from a worker without compiling again (buffers made outside inference mode cost a
    second compile at the first such call: a minute-long stall on the H200, runs 7 and 9)."""
    import torch._dynamo.utils as dynamo_utils

    from cosytrt.engines.cuda_graphs import static_copies
    from cosytrt.runtime.stages.pipeline import Pipeline

    dit = Pipeline.load("tiny").models.flow.estimator  # fresh module: nothing compiled for it yet
    compiled = CompiledDiT.of(dit).fixed(False)
    graphs = lambda: dynamo_utils.counters["stats"]["unique_graphs"]  # noqa: E731
    static = static_copies(example_inputs(dit, 4, 64, seed=1))  # made outside inference mode, as at capture
    assert all(x.is_inference() for x in static)
    with torch.inference_mode():
        compiled(*static)  # what the capture's warm-up runs
        before = graphs()
        worker_args = example_inputs(dit, 6, 50, seed=2)  # a DiT worker's fallback call
        out = compiled(*worker_args)
        assert graphs() == before
        assert (out - dit(*worker_args)).abs().max() <= ATOL


def test_compiled_hift_runs_batch_one_eagerly(tiny_tts, monkeypatch):
    """`CompiledHiFT` sends calls of >= 2 rows to the compiled functions and batch-1 calls to the eager vocoder (dynamo
    would compile batch 1 a second time). Compiling even the tiny HiFT takes minutes on 2 cores, so `compile_fn` is
    replaced by a recorder here; the compiled numbers are checked on the H200 (bench --suite hift: max abs err)."""
    import cosytrt.runtime.stages.compiled as compiled_mod

    calls = []

    def recorder(fn):
        def run(*args):
            calls.append((fn.__name__, args[0].shape[0]))
            return fn(*args)
        return run

    monkeypatch.setattr(compiled_mod, "compile_fn", recorder)
    hift = tiny_tts.pipeline.models.hift
    ch = compiled_mod.CompiledHiFT(hift)
    g = torch.Generator().manual_seed(0)
    spf = hift.samples_per_frame
    with torch.inference_mode():
        for b in (1, 2, 3):
            mel = torch.randn(b, 80, 40, generator=g) * 0.5 - 4.0
            assert torch.equal(ch.offline(mel), hift.inference(mel, finalize=True)[0])
            src = torch.randn(b, 1, 40 * spf, generator=g) * 0.1
            assert torch.equal(ch.stream_window(mel, src), hift.decode(mel, src, finalize=False))
    assert calls == [("_offline_eager", 2), ("_window_eager", 2), ("_offline_eager", 3), ("_window_eager", 3)]
    assert compiled_mod.CompiledHiFT.of(hift) is compiled_mod.CompiledHiFT.of(hift)


def test_stage_backends_route_the_stage_calls(tiny_tts):
    """StageBackends are handed explicitly to whoever runs a stage: a scheduler over them calls their DiT estimator
    of each mode, their offline HiFT and their streaming-window decoder (HiFT variants are different StageBackends),
    with the eager stages' audio; close() runs the closers once."""
    from cosytrt.runtime.stages.backends import StageBackends
    from cosytrt.runtime.tts import make_request

    models = tiny_tts.pipeline.models
    calls = set()

    def estimator(mode):
        def run(*args, streaming=False):
            calls.add(("dit", mode, streaming))
            return models.flow.estimator(*args, streaming=streaming)
        return run

    class Offline:
        def inference_batch(self, mels, finalize=True):
            calls.add(("hift", "offline"))
            return models.hift.inference_batch(mels, finalize)

    def windows(mel, source, finalize):
        calls.add(("hift", "window"))
        return models.hift.decode(mel, source, finalize)

    closed = []
    backends = StageBackends(estimator("stream"), estimator("offline"), Offline(), windows,
                             closers=[lambda: closed.append(1)])
    sched = tiny_tts.make_scheduler(backends=backends)
    try:
        off = sched.submit(make_request("Routed.", seed=5, force_tokens=40)).result(timeout=120)
        stream = np.concatenate(list(sched.submit(make_request("Routed.", seed=5, force_tokens=40, stream=True))
                                     .chunks(timeout=120)))
    finally:
        sched.close()
    assert calls == {("dit", "stream", True), ("dit", "offline", False), ("hift", "offline"), ("hift", "window")}
    ref = tiny_tts.synthesize("Routed.", seed=5, force_tokens=40)
    assert off.shape == ref.shape and np.abs(off - ref).max() <= BATCHED_ATOL
    ref = np.concatenate(list(tiny_tts.stream("Routed.", seed=5, force_tokens=40)))
    assert stream.shape == ref.shape and np.abs(stream - ref).max() <= BATCHED_ATOL
    backends.close()
    backends.close()
    assert closed == [1]


def test_compile_ar_only(tiny_tts, monkeypatch):
    """TTS.load(compile="ar") (`serve --compile --compile-scope ar`): the LM compiled by the scheduler, the DiT /
    HiFT left eager (on CUDA: eager modules in CUDA graphs, the benchmarks' graphs_ar variant); same audio as the
    eager TTS. torch.compile is stubbed: what is checked is which parts ask for it."""
    from cosytrt.runtime.stages import compiled
    from cosytrt.runtime.tts import TTS

    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: asked.append(getattr(fn, "__name__", "?")) or fn)
    monkeypatch.setattr(compiled, "compiled_backends",
                        lambda *a, **k: pytest.fail("compile='ar' must not compile the DiT / HiFT"))
    with TTS.load("tiny", compile="ar") as tts:
        assert tts.scheduler_config.compile is True and asked  # the AR prefill / decode step
        wav = tts.synthesize("Hello there.", seed=0)
    np.testing.assert_array_equal(wav, tiny_tts.synthesize("Hello there.", seed=0))
