"""TensorRT-LLM AR runner: its pure-Python parts (slots and histories, merged-vocab id mapping, executor / request
arguments), the protocol end to end against a stand-in executor that computes what TensorRT-LLM would (the
merged-vocab HF export run by transformers), and the scheduler driving it: merged-vocab prompt ids in, speech-id
logits out, the same tokens as the PyTorch runner. The real executor needs TensorRT-LLM (not installable here: NVIDIA's
index only): skipped with the reason."""
import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from cosytrt.build.hf_export import export_merged_hf, merged_prompt_ids
from cosytrt.engines.errors import BackendUnavailableError, EngineSetError, InputError
from cosytrt.runtime.models.merged_vocab import MergedVocab
from cosytrt.runtime.stages.ar_trtllm import (SlotTable, TrtllmARRunner, build_request, executor_config_kwargs,
                                              import_executor_api, request_kwargs)

TOL = 1e-4


@dataclass
class Row:  # the protocol's PrefillRow (runtime/stages/ar_runner.py)
    slot: int
    embeds: torch.Tensor
    ids: torch.Tensor | None = None


def test_slot_table_bookkeeping():
    t = SlotTable(max_batch=2, max_len=8)
    assert (t.allocate(), t.allocate(), t.allocate()) == (0, 1, None) and t.free == 0
    assert t.start(0, [5, 6, 7]) == [5, 6, 7]
    assert t.feed(0, 9, position=3) == [5, 6, 7, 9]
    with pytest.raises(InputError, match="holds 4 positions"):
        t.feed(0, 9, position=3)
    with pytest.raises(InputError, match="before its prefill"):
        t.feed(1, 9, position=0)
    with pytest.raises(InputError, match="no room"):
        t.start(1, list(range(8)))
    t.start(1, list(range(7)))
    assert len(t.feed(1, 1, position=7)) == 8  # the last position of max_len 8
    with pytest.raises(InputError, match="full"):
        t.feed(1, 1, position=8)
    t.release(0)
    assert t.free == 1 and t.allocate() == 0 and t.history[0] == []
    with pytest.raises(InputError, match="not allocated"):
        t.release(5)


def test_vocab_map_and_arguments():
    meta = {"text_vocab_size": 512, "speech_token_offset": 512, "speech_vocab_size": 6761, "padded_vocab_size": 7296,
            "sos_id": 512 + 6561, "eos_id": 512 + 6562, "task_id": 512 + 6563}
    v = MergedVocab.from_metadata(meta)
    assert v.to_merged(0) == 512 and v.to_merged(6760) == 512 + 6760 and v.to_speech(512 + 6760) == 6760
    for bad in (6761, -1):
        with pytest.raises(InputError):
            v.to_merged(bad)
    with pytest.raises(InputError):
        v.to_speech(511)  # a text id
    lg = torch.arange(7296.0)
    assert torch.equal(v.speech_logits(lg), torch.arange(512.0, 512 + 6761))
    with pytest.raises(EngineSetError):
        v.speech_logits(torch.zeros(100))
    with pytest.raises(EngineSetError, match="lacks"):
        MergedVocab.from_metadata({"text_vocab_size": 1})
    with pytest.raises(EngineSetError, match="above the text ids"):
        MergedVocab.from_metadata({**meta, "speech_token_offset": 100})
    kw = request_kwargs([1, 2, 3], v, slot=4)
    assert kw["input_token_ids"] == [1, 2, 3] and kw["max_tokens"] == 1 and kw["client_id"] == 4
    assert kw["end_id"] == kw["pad_id"] == 512 + 6562
    assert kw["output"]["return_generation_logits"] and kw["sampling"] == {"beam_width": 1, "top_k": 1}
    cfg = executor_config_kwargs(8, 0.4)
    assert cfg["max_batch_size"] == 8 and cfg["kv_cache"] == {"enable_block_reuse": True,
                                                              "free_gpu_memory_fraction": 0.4}
    with pytest.raises(InputError):
        executor_config_kwargs(8, 0.0)
    req = build_request(_FakeApi, kw)
    assert req.input_token_ids == [1, 2, 3] and req.sampling_config.top_k == 1
    assert req.output_config.return_generation_logits


def test_executor_api_absent_is_reported():
    if importlib.util.find_spec("tensorrt_llm") is not None:
        pytest.skip("tensorrt_llm is installed here")
    with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
        import_executor_api()


def test_real_executor_needs_tensorrt_llm():
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installable here (NVIDIA's index only): the "
                        "executor path is written to the documented API and has not run")


# ------------------------------------------------------------------ a stand-in executor

class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeApi:
    Request = SamplingConfig = OutputConfig = _Obj


class _FakeExecutor:
    """What a TensorRT-LLM executor returns for max_tokens=1 requests with generation logits: the logits after the
    whole input (here: transformers on the merged-vocab export, no KV cache)."""

    def __init__(self, hf):
        self.hf, self.next_id, self.pending, self.seen, self.closed = hf, 1, {}, [], False

    def enqueue_requests(self, reqs):
        ids = []
        for r in reqs:
            assert r.max_tokens == 1 and r.output_config.return_generation_logits
            with torch.no_grad():
                logits = self.hf(input_ids=torch.tensor([r.input_token_ids])).logits[0, -1]
            rid, self.next_id = self.next_id, self.next_id + 1
            self.pending[rid] = logits[None, None]  # [beam, tokens, V]
            self.seen.append((r.client_id, list(r.input_token_ids)))
            ids.append(rid)
        return ids

    def await_responses(self, rid, timeout):
        lg = self.pending.pop(rid)
        return [SimpleNamespace(has_error=lambda: False, error_msg="",
                                result=SimpleNamespace(is_final=True, generation_logits=lg))]

    def shutdown(self):
        self.closed = True


@pytest.fixture(scope="module")
def exported(golden_lm, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path_factory.mktemp("hf"))
    meta = export_merged_hf(golden_lm, out)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    return out, meta, hf


def test_protocol_against_stand_in_executor(exported, golden_lm, golden_vectors):
    out, meta, hf = exported
    off = meta["speech_token_offset"]
    ex = _FakeExecutor(hf)
    r = TrtllmARRunner("unused", out, max_batch=2, max_len=256, device="cpu", api=_FakeApi, executor=ex)
    lm = golden_lm
    text, prompt = golden_vectors["llm.text"], golden_vectors["llm.prompt_speech"]
    embeds = lm.build_lm_input(text, prompt)
    ids = merged_prompt_ids(text, prompt, off)
    a, b = r.allocate(), r.allocate()
    assert r.allocate() is None
    # two rows: the full prompt and a shorter one (text only)
    ids_b = merged_prompt_ids(text[..., :5], None, off)
    embeds_b = lm.build_lm_input(text[..., :5])
    assert torch.equal(r.prompt_ids(text, prompt), ids) and torch.equal(r.prompt_ids(text[..., :5], None), ids_b)
    with pytest.raises(InputError, match="line up"):
        r.prefill([Row(a, embeds, ids_b)])
    got = r.prefill([Row(a, embeds, ids), Row(b, embeds_b, ids_b)])
    with torch.no_grad():
        ref_a = lm(embeds[None])[0, -1]
        ref_b = lm(embeds_b[None])[0, -1]
    assert got.shape == (2, 6761) and got.dtype == torch.float32
    assert (got[0] - ref_a).abs().max() <= TOL and (got[1] - ref_b).abs().max() <= TOL
    # two decode steps of row a only, then both rows together
    toks = [int(golden_vectors["llm.target_speech"].reshape(-1)[i]) for i in range(3)]
    hist = embeds
    pos = embeds.shape[0]
    for t in toks[:2]:
        got = r.decode([t], [a], [pos])
        hist = torch.cat([hist, lm.embed_speech(torch.tensor([t]))])
        pos += 1
        with torch.no_grad():
            assert (got[0] - lm(hist[None])[0, -1]).abs().max() <= TOL
    got = r.decode([toks[2], 17], [a, b], [pos, embeds_b.shape[0]])
    with torch.no_grad():
        hist = torch.cat([hist, lm.embed_speech(torch.tensor([toks[2]]))])
        hb = torch.cat([embeds_b, lm.embed_speech(torch.tensor([17]))])
        assert (got[0] - lm(hist[None])[0, -1]).abs().max() <= TOL
        assert (got[1] - lm(hb[None])[0, -1]).abs().max() <= TOL
    assert ex.seen[-1] == (b, ids_b.tolist() + [off + 17])  # the slot's whole history, merged ids
    with pytest.raises(InputError, match="holds"):
        r.decode([1], [a], [pos])  # a stale position
    with pytest.raises(InputError, match="merged-vocab ids"):
        r.prefill([Row(a, embeds)])
    r.release(a)
    assert r.free == 1 and r.stats()["executor_requests"] == 6
    r.close()
    assert ex.closed
    with pytest.raises(EngineSetError, match="closed"):
        r.decode([1], [b], [embeds_b.shape[0] + 1])


# ------------------------------------------------------------------ the merged-vocab id mapping

def test_merged_vocab_mapping_matches_the_lm_input(golden_lm, golden_vectors, exported):
    """The exporter and the runner read one layout (`MergedVocab`): the export's metadata is `MergedVocab.for_lm`;
    `prompt_ids` has one id per position of `build_lm_input` and the export's embedding rows of those ids ARE the
    LM input embeddings; `speech_logits` column i scores speech id i."""
    out, meta, hf = exported
    v = MergedVocab.load(out)
    assert v == MergedVocab.for_lm(golden_lm.config) and v.metadata().items() <= meta.items()
    text, prompt = golden_vectors["llm.text"], golden_vectors["llm.prompt_speech"]
    lm_input = golden_lm.build_lm_input(text, prompt)
    ids = v.prompt_ids(text, prompt)
    assert ids.shape == (lm_input.shape[0],) and ids.dtype == torch.long
    with torch.no_grad():
        assert torch.equal(hf.get_input_embeddings()(ids), lm_input)
        lg = hf(input_ids=ids[None]).logits[0, -1]
        assert (v.speech_logits(lg) - golden_lm(lm_input[None])[0, -1]).abs().max() <= TOL
    t = torch.tensor([0, 6561, 6760])
    assert torch.equal(v.to_speech(v.to_merged(t)), t)
    with pytest.raises(InputError, match="text id out of range"):
        v.prompt_ids([v.text_vocab_size], None)


# ------------------------------------------------------------------ the scheduler drives the TensorRT-LLM runner

@pytest.fixture(scope="module")
def tiny_export(tiny_tts, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    out = str(tmp_path_factory.mktemp("tiny_hf"))
    export_merged_hf(tiny_tts.pipeline.models.llm, out)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    return out, hf


class _RecordingRunner(TrtllmARRunner):
    """The TensorRT-LLM runner over the stand-in executor, recording each prefill's rows."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows = []

    def prefill(self, rows):
        self.rows.extend(rows)
        return super().prefill(rows)


def test_scheduler_passes_merged_ids_and_gets_the_torch_tokens(tiny_tts, tiny_export):
    """Through the Scheduler (several concurrent requests, prefills batched, decode steps shared): the runner gets
    each prompt as merged-vocab ids (`ARRunner.prompt_ids` -> PrefillRow.ids), decode tokens are mapped to merged
    ids, and the speech-id logits it returns give the same tokens as the PyTorch runner for the same seeds."""
    from cosytrt.runtime.models.merged_vocab import MergedVocab
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.scheduling.scheduler import Scheduler, make_ar_runner
    from cosytrt.runtime.stages.ar_runner import default_max_len

    out, hf = tiny_export
    models = tiny_tts.pipeline.models
    cfg = SchedulerConfig(ar_max_batch=4)
    texts = [("Hello there.", 1), ("A second, longer sentence to speak.", 2), ("Third.", 3)]

    def run(runner):
        sched = Scheduler(tiny_tts.pipeline, cfg, runner=runner)
        try:
            hs = [sched.submit(_request(t, seed)) for t, seed in texts]
            for h in hs:
                h.result(timeout=300)
            return [h.tokens for h in hs]
        finally:
            sched.close()

    ex = _FakeExecutor(hf)
    trt = _RecordingRunner("unused", out, max_batch=4, max_len=default_max_len(models), device="cpu", api=_FakeApi,
                           executor=ex)
    torch_runner = make_ar_runner(models, cfg, "cpu")
    assert torch_runner.prompt_ids(torch.tensor([1]), torch.tensor([], dtype=torch.long)) is None
    got, ref = run(trt), run(torch_runner)
    assert got == ref and all(len(t) > 0 for t in got)
    v = MergedVocab.load(out)
    assert len(trt.rows) == len(texts)
    for row in trt.rows:  # every prefill row came with ids, one per LM input position, starting with sos
        assert row.ids is not None and row.ids.shape[0] == row.embeds.shape[0] and int(row.ids[0]) == v.sos_id
    # every executor request: one of the merged prompts, then fed speech tokens as merged ids
    prompts = [r.ids.tolist() for r in trt.rows]
    for _, h in ex.seen:
        p = next(p for p in prompts if h[:len(p)] == p)
        assert all(v.speech_token_offset <= i < v.speech_end for i in h[len(p):])
    assert trt.free == trt.max_batch


def _request(text, seed):
    from cosytrt.runtime.models.sampling import SamplingParams
    from cosytrt.runtime.stages.request import Request

    return Request(text=text, sampling=SamplingParams(seed=seed, max_tokens=40))


def test_make_ar_runner_follows_the_engine_sets_ar_runner(tiny_tts, tiny_export, monkeypatch):
    """An engine set whose manifest says `ar_runner: trtllm` gets the TensorRT-LLM runner (opened through the
    executor bindings: here a stand-in module), one that says `torch` (or no engine set) the PyTorch runner."""
    from cosytrt.runtime.scheduling.config import SchedulerConfig
    from cosytrt.runtime.scheduling.scheduler import make_ar_runner
    from cosytrt.runtime.stages import ar_trtllm
    from cosytrt.runtime.stages.ar_runner import TorchARRunner
    from cosytrt.runtime.stages.engine_set import LoadedEngineSet

    out, hf = tiny_export
    folder = os.path.dirname(out)
    os.makedirs(os.path.join(folder, "ar_trtllm_engine"), exist_ok=True)
    opened = []

    class ExecutorConfig:
        def __init__(self, max_beam_width):
            self.max_beam_width = max_beam_width

    def executor(engine_dir, model_type, config):
        opened.append((engine_dir, model_type, config))
        return _FakeExecutor(hf)

    class Api(_FakeApi):
        KvCacheConfig = _Obj
        ModelType = SimpleNamespace(DECODER_ONLY="decoder-only")

    Api.ExecutorConfig, Api.Executor = ExecutorConfig, staticmethod(executor)
    monkeypatch.setattr(ar_trtllm, "import_executor_api", lambda: Api)
    es = LoadedEngineSet.__new__(LoadedEngineSet)  # what opening a set gives: folder, manifest, checked ar_runner
    es.folder, es.ar_runner = folder, "trtllm"
    es.manifest = SimpleNamespace(commands={"ar_hf_checkpoint": os.path.basename(out)})
    models, cfg = tiny_tts.pipeline.models, SchedulerConfig(ar_max_batch=3)
    r = make_ar_runner(models, cfg, "cpu", es)
    assert isinstance(r, TrtllmARRunner) and r.max_batch == 3
    assert opened[0][0] == os.path.join(folder, "ar_trtllm_engine") and opened[0][1] == "decoder-only"
    assert opened[0][2].max_batch_size == 3 and opened[0][2].kv_cache_config.enable_block_reuse
    r.close()
    es.ar_runner = "torch"
    assert isinstance(make_ar_runner(models, cfg, "cpu", es), TorchARRunner)
    assert isinstance(make_ar_runner(models, cfg, "cpu", None), TorchARRunner)
