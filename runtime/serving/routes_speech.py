"""`POST /v1/audio/speech`: the OpenAI request shape (parsed in request.py) -> a speaker (inline `ref_audio`, a
stored voice or the model's default) -> a `SpeechJob` (one runtime request per sentence) -> one response, whole
(wav | pcm | flac | mp3 | opus) or streamed (streaming.py)."""
import asyncio
import os

import numpy as np

from ...engines.errors import CosytrtError
from .encoding import MEDIA_TYPES, RAW_FORMATS, encode_at, pcm_headers
from .errors import APIError, from_runtime_error, invalid
from .http import check_content_type, read_body_capped, until_done_or_gone
from .jobs import SpeechJob, _ClientGone, segments
from .streaming import audio_stream_response, stream_body


async def resolve_speaker(state, params):
    """The speaker of a request: inline `ref_audio` (decoded off the loop, bounded), a stored voice, or the model's
    default voice."""
    loop = asyncio.get_running_loop()
    tts = state.tts
    if params.ref_audio is not None:
        raw = await loop.run_in_executor(state.decoder, state.ref_audio_bytes, params.ref_audio)
        samples, sr = await loop.run_in_executor(state.decoder, state.decode, raw, "ref_audio")
        try:
            return await loop.run_in_executor(None, lambda: tts.make_speaker(samples, params.ref_text, sr))
        except CosytrtError as e:
            raise from_runtime_error(e, param="ref_audio") from None
    voice = params.voice or "default"
    if voice == "default" and state.voices.builtin is None and not os.path.isfile(state.voices.path(voice)):
        raise invalid("this model has no built-in voice: give 'voice' (a voice saved with POST /v1/voices) or "
                      "'ref_audio' + 'ref_text' (inline cloning)", "voice", "voice_required")
    try:
        return await loop.run_in_executor(None, state.voices.get, voice)
    except CosytrtError as e:
        raise from_runtime_error(e, param="voice") from None


def finisher(state, job: SpeechJob, ticket):
    """finish(outcome): ends the job once (cancels it unless "ok"), gives its admission ticket back, records
    metrics."""
    done = False

    def finish(outcome: str) -> None:
        nonlocal done
        if done:
            return
        done = True
        if outcome != "ok":
            job.cancel()
        state.jobs.discard(job)
        state.release(ticket)
        state.metrics.finish(outcome, job.metrics, ticket.waited)

    return finish


def add_speech_routes(app, state) -> None:
    from fastapi import Request
    from fastapi.responses import Response

    from .request import parse_speech_request  # pydantic (a FastAPI dependency)

    settings, tts = state.settings, state.tts

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        state.check_auth(request)
        state.check_serving()
        check_content_type(request, "application/json")
        cap = max(65536, 8 * settings.max_input_chars + 4096, (settings.upload_cap * 4) // 3 + 8192)
        raw = await read_body_capped(request, cap, "the request body", settings.body_timeout_s, state.big_bodies)
        body = await state.load_json(raw)  # (an inline reference: parsed off the event loop)
        params = parse_speech_request(body, settings)
        try:  # the runtime's admission control decides (429 / 503); a client gone meanwhile leaves the queue
            ticket = await until_done_or_gone(state.admit("speech request"), request)
        except _ClientGone:
            return Response(status_code=499)
        try:
            speaker = await resolve_speaker(state, params)
            texts = await segments(state, params.input, params.options, speaker)
        except BaseException:
            state.release(ticket)
            raise
        options = {"speaker": speaker, **params.options, **state.lease(ticket)}
        if params.speed != 1.0:
            options["speed"] = params.speed
        job = SpeechJob(tts, texts, options, params.stream)
        finish = finisher(state, job, ticket)
        sr = state.sample_rate  # the model's; the response's is params.sample_rate when given
        sr_out = params.sample_rate or sr
        extra = {"X-Ignored-Fields": ",".join(params.ignored)} if params.ignored else {}
        if params.response_format in RAW_FORMATS:
            extra.update(pcm_headers(sr_out, params.response_format))
        chunks = job.chunks()
        try:
            state.jobs.add(job)
            await job.start(state.executor)
            if params.stream:  # wait for the first chunk, so errors before any audio still get a status code
                try:
                    first = await until_done_or_gone(chunks.__anext__(), request)
                except StopAsyncIteration:
                    first = None
                return audio_stream_response(
                    stream_body(job, params, sr, finish, first, chunks), finish,
                    media_type="text/event-stream" if params.sse or params.sse_wav else
                    MEDIA_TYPES[params.response_format],
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **extra})

            async def collect():
                return [c async for c in chunks]

            parts = await until_done_or_gone(collect(), request)
        except _ClientGone:
            finish("cancelled")
            return Response(status_code=499)  # nobody reads it; counted as "client closed request"
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            finish("error")
            if state.draining:
                raise APIError(503, "the server shut down before the request finished", code="shutting_down") \
                    from None
            raise from_runtime_error(e) from None
        except BaseException:
            finish("cancelled")
            raise
        finish("ok")
        wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        headers = {"X-Audio-Seconds": f"{wav.size / sr:.4f}", **extra}
        if job.metrics is not None:
            headers["X-Speech-Tokens"] = str(int(getattr(job.metrics, "tokens", 0) or 0))
        body = await asyncio.get_running_loop().run_in_executor(None, encode_at, wav, sr, sr_out,
                                                                params.response_format)
        return Response(body, media_type=MEDIA_TYPES[params.response_format], headers=headers)
