"""token2wav: speech tokens → mel (flow) → audio (HiFT), offline and streaming.

Streaming follows the upstream hop schedule (CosyVoice2Model.tts): the first hop is padded so that prompt + hop ends on
a 50-frame chunk boundary, hops grow 25 → 50 → 100 tokens, each non-final call runs the flow (block-causal mask) on all
tokens so far plus 3 look-ahead tokens and keeps the new mel, and the last call runs the flow with full attention and
finalize. Unlike upstream, HiFT does not re-run over the whole accumulated mel: `HiFTStream` keeps the causal state a
chunk needs, so each chunk costs O(chunk) while yielding the same samples.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..models.flow import FlowInput
from ..models.hift_stream import HiFTStream
from .backends import StageBackends
from .hop_schedule import HOP_SCALE, LOOKAHEAD, TOKEN_HOP, TOKEN_MAX_HOP, HopSchedule, first_hop  # noqa: F401


def speed_mel(mel: torch.Tensor, speed: float) -> torch.Tensor:
    """An offline request's final mel [B, 80, T] for `Request.speed`: linearly resampled to T / speed frames
    (upstream's way); unchanged at speed 1 or for an empty mel."""
    if speed == 1.0 or mel.shape[-1] == 0:
        return mel
    return torch.nn.functional.interpolate(mel, size=max(1, int(mel.shape[-1] / speed)), mode="linear")


@dataclass
class StreamState:
    """Per-request streaming position: the prompt, the hop schedule, the HiFT stream."""

    prompt_token: torch.Tensor  # [P]
    prompt_feat: torch.Tensor  # [2P, 80]
    embedding: torch.Tensor  # [192]
    hift_stream: HiFTStream
    hops: HopSchedule
    chunks: int = 0
    flow_cache: object = None  # stages.flow_cache.FlowPrefixState: the DiT prefix of earlier hops (None: off)

    def ready(self, n_tokens: int) -> bool:
        """Is a hop due with `n_tokens` generated tokens?"""
        return self.hops.ready(n_tokens)

    @property
    def finished(self) -> bool:
        return self.hops.finished


class Token2Wav:
    """token2wav over a Flow and a HiFT; `backends` says what runs the DiT and HiFT calls (engines, graphs)."""

    def __init__(self, flow, hift, backends: StageBackends | None = None, flow_cache=None):
        self.flow = flow
        self.hift = hift
        self.backends = backends or StageBackends()
        self.flow_cache = flow_cache  # stages.flow_cache.FlowCachePool: streams started here cache DiT prefixes
        self._t_dit = 0.0
        self._t_vocoder = 0.0

    def take_timings(self) -> tuple[float, float]:
        """(seconds in the flow, seconds in HiFT) since the last call."""
        out = (self._t_dit, self._t_vocoder)
        self._t_dit = self._t_vocoder = 0.0
        return out

    def _timed(self, which: str, fn, *args, **kw):
        dev = next(self.flow.parameters()).device
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        if which == "dit":
            self._t_dit += dt
        else:
            self._t_vocoder += dt
        return out

    def _flow(self, tokens: torch.Tensor, st_or_prompt, streaming: bool, finalize: bool, cache=None) -> torch.Tensor:
        p_tok, p_feat, emb = st_or_prompt
        est = self.backends.estimator(streaming)
        if cache is not None:  # a prefix-cached hop: only the frames past the cached prefix are computed
            from .flow_hops import flow_rows

            row = FlowInput(tokens.reshape(-1), p_tok.reshape(-1), p_feat, emb.reshape(-1), finalize, cache)
            return self._timed("dit", flow_rows, self.flow, [row], streaming, est, hops=self.backends.dit_cached)[0]
        kw = {} if est is None else {"estimator": est}
        return self._timed("dit", self.flow.inference, tokens.view(1, -1), p_tok.view(1, -1), p_feat.unsqueeze(0),
                           emb.view(1, -1), streaming=streaming, finalize=finalize, **kw)

    # ------------------------------------------------------------------ offline
    @torch.inference_mode()
    def offline(self, tokens, prompt_token, prompt_feat, embedding, speed: float = 1.0) -> torch.Tensor:
        """All tokens through flow (full attention, finalize) and HiFT (finalize), the mel resampled for `speed`
        (`speed_mel`). Returns wav [S]."""
        mel = self._flow(tokens, (prompt_token, prompt_feat, embedding), streaming=False, finalize=True)
        return self._timed("vocoder", self.vocode_batch, [speed_mel(mel, speed)[0]])[0]

    def vocode_batch(self, mels: list) -> list:
        """Offline HiFT of several mels [80, T_i] (engine buckets when attached); exact per row."""
        if self.backends.hift_offline is not None:
            return [w.reshape(-1) for w in self.backends.hift_offline.inference_batch(mels, finalize=True)]
        if len(mels) == 1:
            return [self.hift.inference(mels[0].unsqueeze(0), finalize=True)[0].reshape(-1)]
        return [w.reshape(-1) for w in self.hift.inference_batch(mels, finalize=True)]

    # ------------------------------------------------------------------ streaming
    def start(self, prompt_token, prompt_feat, embedding, cache_pool=None) -> StreamState:
        """A stream's state; with a FlowCachePool (`cache_pool`, else this Token2Wav's `flow_cache`) its non-final
        DiT hops reuse the earlier hops' K/V (stages/flow_cache.py)."""
        prompt_token = prompt_token.reshape(-1)
        pool = cache_pool if cache_pool is not None else self.flow_cache
        return StreamState(prompt_token=prompt_token, prompt_feat=prompt_feat, embedding=embedding.reshape(-1),
                           hift_stream=HiFTStream(self.hift, decoder=self.backends.hift_stream_windows),
                           hops=HopSchedule(int(prompt_token.numel())),
                           flow_cache=None if pool is None else pool.new_state())

    @torch.inference_mode()
    def step(self, st: StreamState, tokens: torch.Tensor, final: bool) -> torch.Tensor | None:
        """Advance one request: returns a PCM chunk [S] when one is due (or when `final`), else None.

        `tokens` are all generated tokens so far; `final` means the LM has finished."""
        n = int(tokens.numel())
        prompt = (st.prompt_token, st.prompt_feat, st.embedding)
        if not final:
            if not st.ready(n):
                return None
            offset, upto = st.hops.advance()
            mel = self._flow(tokens[: upto + LOOKAHEAD], prompt, streaming=True, finalize=False, cache=st.flow_cache)
        else:
            if st.finished:
                return None
            if st.flow_cache is not None:  # the final hop is a full-attention pass over everything
                st.flow_cache.close()
            offset = st.hops.finish(n)
            mel = self._flow(tokens, prompt, streaming=False, finalize=True)
        wav = self._timed("vocoder", st.hift_stream.push, mel[:, :, 2 * offset:], finalize=final)
        st.chunks += 1
        return wav.reshape(-1)

    def stream_all(self, tokens, prompt_token, prompt_feat, embedding) -> Iterator[torch.Tensor]:
        """Stream a request whose tokens are all known (the golden streaming loop): hops as tokens allow, then final."""
        st = self.start(prompt_token, prompt_feat, embedding)
        tokens = tokens.reshape(-1)
        while st.ready(int(tokens.numel())):
            yield self.step(st, tokens, final=False)
        yield self.step(st, tokens, final=True)
