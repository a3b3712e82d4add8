"""The library entry point: `from cosytrt.runtime import TTS`.

    tts = TTS.load(model="tiny", engines=None, device="cpu")
    wav = tts.synthesize("Hello there.", seed=0)            # float32 PCM at tts.sample_rate
    for chunk in tts.stream("Hello there.", seed=0): ...     # streaming PCM chunks
"""
from __future__ import annotations

from typing import AsyncIterator, Iterator

import numpy as np
import torch

from .errors import InputError
from .frontend import SavedSpeaker, save_speaker
from .pipeline import Pipeline, make_frontend
from .request import Request, RequestMetrics
from .sampling import SamplingParams

_SAMPLING_KEYS = {"top_p", "top_k", "win_size", "tau_r", "seed", "greedy", "max_tokens", "min_tokens", "force_tokens"}


def make_request(text: str, *, prompt_wav=None, prompt_sr=None, prompt_text=None, instruct=None, speaker=None,
                 stream: bool = False, **sampling) -> Request:
    unknown = set(sampling) - _SAMPLING_KEYS
    if unknown:
        raise InputError(f"unknown synthesis option(s): {sorted(unknown)}")
    return Request(text=text, prompt_wav=prompt_wav, prompt_sr=prompt_sr, prompt_text=prompt_text,
                   instruct=instruct, speaker=speaker, stream=stream, sampling=SamplingParams(**sampling))


class TTS:
    """CosyVoice3 synthesis over eager models or an engine set."""

    def __init__(self, pipeline: Pipeline, engines: str | None = None):
        self.pipeline = pipeline
        self.engines = engines
        self.sample_rate = pipeline.sample_rate
        self._history: list[RequestMetrics] = []

    @classmethod
    def load(cls, model: str = "tiny", engines: str | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None) -> "TTS":
        pipeline = Pipeline.load(model, device=device, dtype=dtype)
        if engines is not None:
            from .engine_set import attach_engine_set

            attach_engine_set(pipeline, engines)
        return cls(pipeline, engines)

    # ------------------------------------------------------------------ voices
    def make_speaker(self, prompt_wav, prompt_text: str = "", prompt_sr: int | None = None) -> SavedSpeaker:
        feats = self.pipeline.frontend.prompt_features(prompt_wav, prompt_sr)
        return SavedSpeaker(features=feats, prompt_text=prompt_text)

    def save_speaker(self, path: str, prompt_wav, prompt_text: str = "", prompt_sr: int | None = None) -> SavedSpeaker:
        spk = self.make_speaker(prompt_wav, prompt_text, prompt_sr)
        save_speaker(path, spk.features, spk.prompt_text)
        return spk

    # ------------------------------------------------------------------ synthesis
    def synthesize_request(self, req: Request) -> tuple[np.ndarray, RequestMetrics]:
        wav, m = self.pipeline.synthesize(req)
        self._history.append(m)
        return wav, m

    def synthesize(self, text: str, **kw) -> np.ndarray:
        kw.pop("stream", None)
        return self.synthesize_request(make_request(text, **kw))[0]

    def stream(self, text: str, **kw) -> Iterator[np.ndarray]:
        kw.pop("stream", None)
        req = make_request(text, stream=True, **kw)
        m = RequestMetrics(request_id=req.request_id, stream=True)
        yield from self.pipeline.run(req, m)
        self._history.append(m)

    async def astream(self, text: str, **kw) -> AsyncIterator[np.ndarray]:
        import asyncio

        it = self.stream(text, **kw)
        loop = asyncio.get_running_loop()
        sentinel = object()
        while True:
            chunk = await loop.run_in_executor(None, next, it, sentinel)
            if chunk is sentinel:
                return
            yield chunk

    def metrics(self) -> dict:
        from .metrics import aggregate

        return aggregate(self._history)

    def close(self) -> None:
        pass
