"""`WS /v1/audio/speech/stream`: text in pieces, audio per sentence — the session protocol sglang-omni's serving
harness (benchmarks/tts_serving/ws_client.py) speaks:

    client: {"type": "session.config", "model", "voice", "response_format": "pcm", "stream_audio": bool,
             "split_granularity": "sentence" | "clause", ...any /v1/audio/speech field (seed, ref_audio, ...)}
    server: {"type": "session.configured", "session_id", "response_format", "stream_audio", "split_granularity"}
    client: {"type": "input.text", "text": "..."} (any number), then {"type": "input.done"}
    server, per sentence (as soon as its text is complete): {"type": "audio.start", "sentence_index",
            "sentence_text", "format": "pcm", "sample_rate"}, binary 16-bit PCM frames (each runtime chunk with
            stream_audio, else the whole sentence), {"type": "audio.done", "sentence_index", "total_bytes",
            "error": false}
    server, at the end: {"type": "session.done", "total_sentences"}, then it closes the socket.
    on a bad message or a failed sentence: {"type": "error", "error": {OpenAI error fields}, "code"} and close.

Each sentence is admitted by the runtime's admission control on its own (a refusal is an error event). The
handshake is checked like HTTP: API key (Authorization header), Host (app.py's guard) and Origin (browsers let any
page open a WebSocket, so a keyless localhost server refuses foreign origins)."""
import asyncio
import json
import re
import uuid

import numpy as np

from .encoding import pcm16
from .errors import APIError, from_runtime_error, invalid
from .jobs import SpeechJob, tracked_job
from .routes_speech import resolve_speaker

_ENDS = {"sentence": re.compile(r"(?<=[。！？!?])|(?<=[.;；])(?=\s|$)|\n+"),
         "clause": re.compile(r"(?<=[。！？!?，、；：,;:])|(?<=[.])(?=\s|$)|\n+")}
CONFIG_KEYS = {"type", "stream_audio", "split_granularity"}
MAX_TEXT_CHARS_FACTOR = 4  # a session's text, at most this many times --max-input-chars


def take_complete(buffer: str, granularity: str, final: bool) -> tuple[list[str], str]:
    """Complete sentences (clauses) of `buffer` and the unfinished rest (everything when `final`)."""
    parts = [p for p in _ENDS[granularity].split(buffer)]
    rest = "" if final else parts.pop()
    return [p.strip() for p in parts if p.strip()], rest


def add_ws_routes(app, state) -> None:
    from fastapi import WebSocket, WebSocketDisconnect

    from .request import parse_speech_request

    settings = state.settings

    async def send_error(ws, e: BaseException) -> None:
        err = from_runtime_error(e)
        await ws.send_json({"type": "error", "error": {**err.body()["error"], "status": err.status},
                            "code": err.code or "error"})
        await ws.close(code=1008 if err.status < 500 else 1011)

    async def receive_json(ws) -> dict:
        msg = await ws.receive_text()
        try:
            event = json.loads(msg)
        except json.JSONDecodeError:
            raise invalid("messages must be JSON objects", "type", "invalid_json") from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise invalid("messages must be JSON objects with a 'type'", "type", "invalid_type")
        return event

    async def speak(ws, index: int, text: str, base: dict, stream_audio: bool) -> int:
        params = parse_speech_request({**base, "input": text}, settings)
        async with state.admitted("websocket sentence") as ticket:
            speaker = await resolve_speaker(state, params)
            options = {"speaker": speaker, **params.options, **state.lease(ticket)}
            if params.speed != 1.0:
                options["speed"] = params.speed
            job = SpeechJob(state.tts, [text], options, stream_audio)
            sent = 0
            async with tracked_job(state, job, ticket):
                await ws.send_json({"type": "audio.start", "sentence_index": index, "sentence_text": text,
                                    "format": "pcm", "sample_rate": state.sample_rate})
                if stream_audio:
                    async for chunk in job.chunks():
                        data = pcm16(chunk)
                        if data:
                            await ws.send_bytes(data)
                            sent += len(data)
                else:
                    parts = [c async for c in job.chunks()]
                    data = pcm16(np.concatenate(parts)) if parts else b""
                    if data:
                        await ws.send_bytes(data)
                        sent = len(data)
        await ws.send_json({"type": "audio.done", "sentence_index": index, "total_bytes": sent, "error": False})
        return sent

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket):
        if state.api_key is not None:
            try:
                state.check_auth(ws)
            except APIError:
                await ws.close(code=1008)  # before accept: the handshake is refused (HTTP 403)
                return
        await ws.accept()
        try:
            state.check_serving()
            config = await receive_json(ws)
            if config["type"] != "session.config":
                raise invalid("the first message must be {'type': 'session.config', ...}", "type", "invalid_value")
            stream_audio = config.get("stream_audio", False)
            granularity = config.get("split_granularity", "sentence")
            if not isinstance(stream_audio, bool):
                raise invalid("'stream_audio' must be true or false", "stream_audio", "invalid_type")
            if granularity not in _ENDS:
                raise invalid("'split_granularity' must be 'sentence' or 'clause'", "split_granularity",
                              "unsupported_value")
            base = {k: v for k, v in config.items() if k not in CONFIG_KEYS}
            base.setdefault("model", settings.model)
            if base.setdefault("response_format", "pcm") != "pcm":
                raise invalid("this stream sends 16-bit PCM frames: 'response_format' must be 'pcm'",
                              "response_format", "unsupported_value")
            for k in ("stream", "stream_format"):
                if k in base:
                    raise invalid(f"'{k}' is not a session field (use 'stream_audio')", k, "unknown_parameter")
            checked = parse_speech_request({**base, "input": "x"}, settings)  # the session's fields, checked once
            if stream_audio and checked.speed != 1.0:
                raise invalid("speed applies to whole sentences only: send stream_audio false or speed 1.0", "speed",
                              "unsupported_value")
            await ws.send_json({"type": "session.configured", "session_id": f"ws-{uuid.uuid4().hex[:16]}",
                                "response_format": "pcm", "stream_audio": stream_audio,
                                "split_granularity": granularity})
            buffer, index, total_chars, done = "", 0, 0, False
            while not done:
                event = await receive_json(ws)
                if event["type"] == "input.text":
                    text = event.get("text")
                    if not isinstance(text, str):
                        raise invalid("'text' must be a string", "text", "invalid_type")
                    total_chars += len(text)
                    if total_chars > MAX_TEXT_CHARS_FACTOR * settings.max_input_chars:
                        raise APIError(413, f"the session's text exceeds "
                                            f"{MAX_TEXT_CHARS_FACTOR * settings.max_input_chars} characters",
                                       param="text", code="input_too_long")
                    buffer += text
                elif event["type"] == "input.done":
                    done = True
                else:
                    raise invalid(f"unexpected message type {event['type']!r} (input.text or input.done)", "type",
                                  "invalid_value")
                sentences, buffer = take_complete(buffer, granularity, final=done)
                for sentence in sentences:
                    await speak(ws, index, sentence, base, stream_audio)
                    index += 1
            await ws.send_json({"type": "session.done", "total_sentences": index})
            await ws.close(code=1000)
        except WebSocketDisconnect:
            return  # the client left; speak() cancelled its job
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - an error event, then close
            try:
                await send_error(ws, e)
            except Exception:  # noqa: BLE001 - the socket is already gone
                pass
