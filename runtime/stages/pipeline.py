"""One request end to end, eagerly: frontend → AR LM → flow → HiFT, offline or streaming, with per-stage timings.

This is the reference path (and the runtime's single-request fallback); the scheduler (`runtime/scheduling/`) runs the
same steps batched across requests.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import torch

from ..models.frontend import Frontend, SavedSpeaker
from ..models.loading import CosyVoice3Models, load_models
from .request import Request, RequestMetrics, default_voice_wav, prepare_inputs
from ..models.sampling import generate
from ..models.text import ByteTokenizer
from .backends import StageBackends
from .token2wav import Token2Wav


# Opt-in: "1" keeps cuDNN's TF32 convolutions on for the HiFT's fp32 convolutions. Under load those convolutions run
# on CUDA cores (ffma implicit-GEMM kernels): 10-16 % of the device's wall time in run 63's 12 req/s kernel profiles
# (the vocoder thread's kernels 16-24 %). Run 64 (H100, `benchmarks/hift_tf32_check.py`): the wav within 1.2e-4 of
# fp32 (golden bound 2e-3), 0.53x the time of a 2000-frame offline call and 0.78x at 400 frames, but 1.13x / 1.23x
# for a 200-frame stream window / a 100-frame call (cuDNN picks other kernels) — so it stays off by default.
HIFT_TF32_ENV = "COSYTRT_HIFT_TF32"


def hift_tf32() -> bool:
    """Whether cuDNN may run the HiFT's fp32 convolutions in TF32 (`COSYTRT_HIFT_TF32=1`; off by default)."""
    return os.environ.get(HIFT_TF32_ENV, "0") == "1"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Pipeline:
    """Eager single-request synthesis over loaded models."""

    def __init__(self, models: CosyVoice3Models, frontend: Frontend, default_speaker: SavedSpeaker | None,
                 backends: StageBackends | None = None):
        self.models = models
        self.frontend = frontend
        self.default_speaker = default_speaker
        self.backends = backends or StageBackends()
        self.token2wav = Token2Wav(models.flow, models.hift, self.backends)
        self.sample_rate = models.config.sample_rate
        self.device = next(models.llm.parameters()).device
        if self.device.type == "cuda":
            # HiFT runs in float32 and its sine-source phase is sensitive: keep cuDNN convolutions out of TF32
            # (the LM and DiT run in bf16/fp16, which TF32 does not affect) unless asked (`HIFT_TF32_ENV`)
            torch.backends.cudnn.allow_tf32 = hift_tf32()

    def set_backends(self, backends: StageBackends) -> None:
        """Run the DiT / HiFT stages through `backends` from now on (the eager reference: `StageBackends()`)."""
        self.backends = backends
        self.token2wav = Token2Wav(self.models.flow, self.models.hift, backends)

    @classmethod
    def load(cls, model: str = "tiny", device: str = "cpu", dtype: torch.dtype | None = None) -> "Pipeline":
        models = load_models(model, device=device, dtype=dtype)
        frontend, speaker = make_frontend(models)
        return cls(models, frontend, speaker)

    def run(self, req: Request, metrics: RequestMetrics | None = None) -> Iterator[np.ndarray]:
        """Yield float32 PCM chunks (one chunk when offline); fills `metrics` as it goes."""
        m = metrics or RequestMetrics(request_id=req.request_id, stream=req.stream)
        t0 = time.perf_counter()
        inputs = prepare_inputs(self.frontend, req, self.default_speaker)
        m.t_tokenizer = time.perf_counter() - t0
        llm = self.models.llm
        dev = self.device
        t2w = self.token2wav
        lm_input = llm.build_lm_input(inputs.text_ids.to(dev), inputs.prompt_speech_tokens.to(dev))
        prompt = (inputs.flow_prompt_tokens.to(dev), inputs.flow_prompt_mel.to(dev), inputs.embedding.to(dev))
        self._check_noise(inputs, req)
        tokens: list[int] = []
        state = t2w.start(*prompt) if req.stream else None
        t_ar = time.perf_counter()
        for tok in generate(llm, lm_input, inputs.text_len, req.sampling):
            tokens.append(tok)
            if state is not None and state.ready(len(tokens)):
                _sync(dev)
                m.t_ar += time.perf_counter() - t_ar
                yield self._emit(t2w.step(state, torch.tensor(tokens, device=dev), final=False), m)
                t_ar = time.perf_counter()
        _sync(dev)
        m.t_ar += time.perf_counter() - t_ar
        m.tokens = len(tokens)
        tok_t = torch.tensor(tokens, dtype=torch.long, device=dev)
        if state is not None:
            yield self._emit(t2w.step(state, tok_t, final=True), m)
        else:
            yield self._emit(t2w.offline(tok_t, *prompt, speed=req.speed), m)
        m.t_dit, m.t_vocoder = t2w.take_timings()
        m.total = time.perf_counter() - m.t_submit

    def _emit(self, wav: torch.Tensor, m: RequestMetrics) -> np.ndarray:
        out = wav.detach().float().cpu().numpy().reshape(-1)
        m.mark_chunk(out.size, self.sample_rate)
        return out

    def noise_room(self, inputs) -> int:
        """Most speech tokens a request with these inputs can generate before its prompt + output mel frames
        exceed the fixed noise buffers."""
        limit = min(self.models.flow.max_frames, self.models.hift.max_frames)
        return limit // 2 - int(inputs.flow_prompt_tokens.numel())

    def _check_noise(self, inputs, req: Request) -> None:
        """Fail before any work when prompt + the longest possible output exceeds the fixed noise buffers.

        An explicit `max_tokens` cap is a bound, not a demand: it is clamped to the room left (the scheduler's
        policy does it), so only `force_tokens` or the default length budget can fail here."""
        from ...engines.errors import RequestTooLongError
        from ..models.sampling import TokenPolicy

        policy = TokenPolicy(inputs.text_len, req.sampling, self.models.config.llm.speech_token_size)
        frames = 2 * (int(inputs.flow_prompt_tokens.numel()) + policy.max_len)
        limit = min(self.models.flow.max_frames, self.models.hift.max_frames)
        capped = req.sampling.force_tokens is None and req.sampling.max_tokens is not None
        if frames > limit and not (capped and self.noise_room(inputs) >= 1):
            raise RequestTooLongError(
                f"request needs up to {frames} mel frames (prompt {2 * int(inputs.flow_prompt_tokens.numel())} + up to "
                f"{2 * policy.max_len} generated) but the fixed noise buffers hold {limit}: shorten the text or the "
                f"prompt, or set max_tokens")

    def synthesize(self, req: Request) -> tuple[np.ndarray, RequestMetrics]:
        m = RequestMetrics(request_id=req.request_id, stream=req.stream)
        chunks = list(self.run(req, m))
        return (np.concatenate(chunks) if chunks else np.zeros(0, np.float32)), m


def make_frontend(models: CosyVoice3Models) -> tuple[Frontend, SavedSpeaker | None]:
    """The frontend for a model source, and its built-in voice (the tiny model has one; real models do not)."""
    if models.kind == "real":
        from ..models.config import ENDOFPROMPT_TEXT_ID
        from ..models.text import QwenTokenizer

        full_vocab = models.config.llm.qwen.vocab_size == 151936  # the released Qwen2 text vocabulary
        tok = QwenTokenizer(os.path.join(models.model_dir, "CosyVoice-BlankEN"),
                            expected_endofprompt_id=ENDOFPROMPT_TEXT_ID if full_vocab else None)
        return Frontend.from_model_dir(models.model_dir, tokenizer=tok), None
    from ..models.loading import ensure_tiny_dir

    d = models.model_dir if os.path.isfile(os.path.join(models.model_dir, "campplus.onnx")) else ensure_tiny_dir()
    frontend = Frontend(ByteTokenizer(models.config.llm.qwen.vocab_size), os.path.join(d, "speech_tokenizer_v3.onnx"),
                        os.path.join(d, "campplus.onnx"))
    feats = frontend.prompt_features(default_voice_wav(16000), 16000)
    return frontend, SavedSpeaker(features=feats, prompt_text="This is the built-in voice.")
