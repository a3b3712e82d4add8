"""Streamed speech responses: the body of a streamed request (chunked wav / pcm, or OpenAI's SSE audio-delta
events) and a response that finishes its job however the stream ends (success, error, client gone)."""
import asyncio
import base64
import json
import logging

from .encoding import Resampler, raw_audio, wav_header

log = logging.getLogger("cosytrt.server")


def sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def sse_delta(data: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})


def sse_wav_chunk(pcm: bytes, sr: int) -> bytes:
    """One chunk as a complete little WAV in `audio.data` (what older sglang-omni seedtts --stream clients read: the
    duration from each WAV's header, the samples after it)."""
    wav = wav_header(sr, len(pcm) // 2) + pcm
    return sse_event({"type": "speech.audio.delta",
                      "audio": {"data": base64.b64encode(wav).decode("ascii"), "format": "wav", "sample_rate": sr}})


class ClientStalled(Exception):
    """A streamed response's (or websocket session's) client took nothing for the send timeout."""


async def bounded_send(awaitable, timeout: float | None):
    """`await awaitable` (a send to the client) within `timeout` seconds, else ClientStalled: a client that stops
    reading must not hold its admission slot, runtime request, websocket place or connection for ever. The server
    bounds every send of every response and websocket this way (`app._Guard`)."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError:
        raise ClientStalled from None


def audio_stream_response(body, finish, **kw):
    """A StreamingResponse over `body` that always calls `finish("cancelled")` at the end (a no-op when the body
    already finished the job), however the stream ends: success, error, the client gone, or a client that stopped
    reading (every send is bounded by the server's send timeout: `app._Guard`, `bounded_send`)."""
    from fastapi.responses import StreamingResponse

    class AudioStream(StreamingResponse):
        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                try:
                    await self.body_iterator.aclose()
                finally:
                    finish("cancelled")

    return AudioStream(body, **kw)


async def stream_body(job, params, sr_in: int, finish, first, rest):
    """The bytes of a streamed response: a wav header (wav), then each chunk as 16-bit PCM or G.711 (resampled from the
    model's `sr_in` to `params.sample_rate` when given: the stream's bytes are then exactly those of the resampled
    whole), each wrapped in an SSE delta event when `params.sse` (then a final `speech.audio.done` event with usage),
    or each as its own WAV in an SSE event when `params.sse_wav` (then usage and `[DONE]`); `finish(outcome)` at
    the end."""
    outcome = "cancelled"
    samples = 0
    sr = params.sample_rate or sr_in
    resample = Resampler(sr_in, sr)

    def encode(data: bytes) -> bytes:
        if params.sse_wav:
            return sse_wav_chunk(data, sr) if data else b""
        return sse_delta(data) if params.sse else data

    def bytes_of(x):  # samples at the output rate -> the response's bytes (b"" for none)
        nonlocal samples
        samples += x.size
        return encode(raw_audio(x, params.response_format)) if x.size else b""

    try:
        if params.response_format == "wav" and not params.sse_wav:
            yield encode(wav_header(sr, None))
        if first is not None:
            data = bytes_of(resample(first))
            if data:
                yield data
            async for chunk in rest:
                data = bytes_of(resample(chunk))
                if data:
                    yield data
            data = bytes_of(resample.flush())
            if data:
                yield data
        outcome = "ok"
        if params.sse_wav:
            m = job.metrics
            tokens = int(getattr(m, "tokens", 0) or 0)
            yield sse_event({"type": "speech.audio.done", "audio_seconds": samples / sr,
                             "usage": {"prompt_tokens": 0, "completion_tokens": tokens,
                                       "engine_time_s": float(getattr(m, "total", 0.0) or 0.0)}})
            yield b"data: [DONE]\n\n"
        elif params.sse:
            tokens = int(getattr(job.metrics, "tokens", 0) or 0)
            yield sse_event({"type": "speech.audio.done",
                             "usage": {"input_tokens": 0, "output_tokens": tokens, "total_tokens": tokens},
                             "audio_seconds": samples / sr})
    except Exception:  # noqa: BLE001 - the status line is already sent: end the stream
        outcome = "error"
        log.exception("synthesis failed mid-stream")
    finally:
        finish(outcome)
