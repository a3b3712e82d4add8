"""`WS /v1/audio/speech/stream`: text in pieces, audio per sentence — the session protocol sglang-omni's serving
harness (benchmarks/tts_serving/ws_client.py) speaks, plus barge-in:

    client: {"type": "session.config", "model", "voice", "response_format": "pcm" | "ulaw" | "alaw",
             "stream_audio": bool, "split_granularity": "sentence" | "clause", ...any /v1/audio/speech field (seed,
             ref_audio, sample_rate, ...)}
    server: {"type": "session.configured", "session_id", "response_format", "stream_audio", "split_granularity",
             "sample_rate"}
    client: {"type": "input.text", "text": "..."} (any number), then {"type": "input.done"}
    server, per sentence (as soon as its text is complete): {"type": "audio.start", "sentence_index",
            "sentence_text", "format", "sample_rate"}, binary frames, 16-bit PCM or G.711 (each runtime chunk with
            stream_audio, else the whole sentence), {"type": "audio.done", "sentence_index", "total_bytes",
            "error": false}
    client: {"type": "input.flush"} -> the text so far is spoken now even without a sentence end (the end of an
            agent's turn); the session stays open for more text.
    client, at any time (barge-in): {"type": "input.cancel"} -> the sentences being synthesised are cancelled (a
            started one ends with {"type": "audio.done", ..., "cancelled": true}), complete sentences not yet
            started and the unfinished text are dropped, then {"type": "input.cancelled", "sentence_indices": [...]};
            the session goes on (the next sentence gets the next index).
    server, at the end: {"type": "session.done", "total_sentences"}, then it closes the socket.
    on a bad message or a failed sentence: {"type": "error", "error": {OpenAI error fields}, "code"} and close.

The socket is read while audio is sent (a cancel or more text is seen at once). With `ws_lookahead` (default 0: off)
the next complete sentences are synthesised while the current one streams (audio always sent in sentence order);
later sentences carry priority hints (`ws_buffer_hints`: the audio the listener still has, the request they play
after). Each sentence is
admitted by the runtime's admission control on its own (a refusal is an error event). The handshake is checked like
HTTP: API key (Authorization header), Host (app.py's guard) and Origin (browsers let any page open a WebSocket, so a
keyless localhost server refuses foreign origins); a message is at most `ws_max_bytes` (uvicorn closes the socket
on a bigger one) and nests JSON at most `--max-json-depth` deep."""
import asyncio
import collections
import logging
import re
import time
import uuid

import numpy as np

from .encoding import RAW_FORMATS, Resampler, raw_audio
from .errors import APIError, from_runtime_error, invalid
from .jobs import SpeechJob, segments, tracked_job
from .routes_speech import resolve_speaker
from .streaming import ClientStalled

_ENDS = {"sentence": re.compile(r"(?<=[。！？!?])|(?<=[.;；])(?=\s|$)|\n+"),
         "clause": re.compile(r"(?<=[。！？!?，、；：,;:])|(?<=[.])(?=\s|$)|\n+")}
CONFIG_KEYS = {"type", "stream_audio", "split_granularity"}
SPEAKER_KEYS = {"ref_audio", "ref_text", "references"}  # resolved once per session, not parsed again per sentence
MAX_TEXT_CHARS_FACTOR = 4  # a session's text, at most this many times --max-input-chars
# client messages read ahead of the session loop: a client that floods messages while the loop waits to send it audio
# (it does not read) is not read further, instead of queueing them in memory without bound
WS_INBOX_MAX = 64
log = logging.getLogger("cosytrt.server")
_START, _END = object(), object()  # a sentence's queue: _START, chunks, _END (or an exception)


_AMBIGUOUS_END = {"sentence": ".;；", "clause": "."}  # an end only when whitespace (or the end of input) follows


def take_complete(buffer: str, granularity: str, final: bool) -> tuple[list[str], str]:
    """Complete sentences (clauses) of `buffer` and the unfinished rest (everything when `final`). A '.' (';')
    that ends the buffer is not yet an end: text arrives in pieces (an LLM's tokens), and "3." may go on as
    "3.14" — it ends a sentence once whitespace follows it, or at the end of input."""
    held = ""
    if not final and buffer and buffer[-1] in _AMBIGUOUS_END[granularity]:
        buffer, held = buffer[:-1], buffer[-1]
    parts = _ENDS[granularity].split(buffer)
    rest = "" if final else parts.pop() + held
    return [p.strip() for p in parts if p.strip()], rest


def ws_max_bytes(settings) -> int:
    """The largest WebSocket message a session needs (a config with an inline base64 `ref_audio`, or text)."""
    return max(65536, 8 * settings.max_input_chars + 4096, (settings.upload_cap * 4) // 3 + 8192)


class _Sentence:
    """One sentence of a session: its synthesis task fills `out` with _START, float32 chunks (already at the
    session's output rate), then _END or the exception that ended it."""

    def __init__(self, index: int, text: str):
        self.index, self.text = index, text
        self.out: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.job = None  # its SpeechJob (job.handle: the runtime request, the next sentence's `after`)
        self.announced = False  # audio.start sent
        self.sent = 0
        self.held: list[np.ndarray] = []  # stream_audio false: the sentence's samples until it ends

    @property
    def handle(self):
        """Its runtime request once submitted (a sentence after it may start then), else None."""
        return None if self.job is None else self.job.handle


def add_ws_routes(app, state) -> None:
    from fastapi import WebSocket, WebSocketDisconnect

    from .request import parse_speech_request

    settings = state.settings

    async def send_error(ws, e: BaseException, close_code: int | None = None) -> None:
        err = from_runtime_error(e)
        await ws.send_json({"type": "error", "error": {**err.body()["error"], "status": err.status},
                            "code": err.code or "error"})
        await ws.close(code=close_code or (1008 if err.status < 500 else 1011))

    def idle_closed() -> APIError:
        state.metrics.ws_event("idle_closed")
        return APIError(408, f"no message for {settings.ws_idle_timeout_s:g} s with nothing to synthesise: session "
                             f"closed (--ws-idle-timeout-s)", code="session_idle")

    async def receive_json(ws, idle_s: float | None = None) -> dict:
        try:
            message = await asyncio.wait_for(ws.receive(), idle_s)
        except asyncio.TimeoutError:
            raise idle_closed() from None
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000), message.get("reason"))
        msg = message.get("text")
        if msg is None:
            raise invalid("messages must be JSON text frames, not binary", "type", "invalid_type")
        # depth-checked; 400 if not JSON; a config with an inline reference parsed off the event loop
        event = await state.load_json(msg.encode("utf-8", "surrogatepass"))
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise invalid("messages must be JSON objects with a 'type'", "type", "invalid_type")
        return event

    async def synthesize(s: _Sentence, base: dict, speaker, stream_audio: bool, sr_out: int, ticket=None,
                         buffered_s: float = 0.0, after=None) -> None:
        """The sentence's synthesis into `s.out` (admission unless `ticket` is given; normalised and split where it
        is too long for the model, as an HTTP input is; one SpeechJob) in the session's `speaker`; cancelled with its
        task. `buffered_s` (audio the listener still has to play) and `after` (the runtime handle of the session's
        previous sentence): the runtime's priority hints."""
        try:
            try:
                params = parse_speech_request({**base, "input": s.text}, settings)
                if ticket is None:  # a session's later sentences are not shed (its listener is mid-conversation)
                    ticket = await state.admit("websocket sentence", shed=after is None)
                texts = await segments(state, s.text, params.options, speaker)
                options = {"speaker": speaker, **params.options, **state.lease(ticket)}
                if params.speed != 1.0:
                    options["speed"] = params.speed
                if settings.ws_buffer_hints:
                    if buffered_s > 0:
                        options["buffered_s"] = min(buffered_s, 3599.0)
                    if after is not None:
                        options["after"] = after
                job = SpeechJob(state.tts, texts, options, stream_audio)
                s.job = job
                resample = Resampler(state.sample_rate, sr_out)
                async with tracked_job(state, job, ticket):
                    s.out.put_nowait(_START)
                    async for chunk in job.chunks():
                        s.out.put_nowait(resample(chunk))
                    s.out.put_nowait(resample.flush())
            finally:  # however it ends (cancelled included), the ticket goes back: given or admitted here
                if ticket is not None:
                    state.release(ticket)
            s.out.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the session sends it as an error event
            s.out.put_nowait(e)

    async def read_events(ws, inbox: asyncio.Queue) -> None:
        """Every client message after the config into `inbox` as it arrives (the session loop reacts to a cancel
        while it sends audio); a bad message or the client leaving ends the reading."""
        total_chars = 0
        try:
            while True:
                event = await receive_json(ws)
                kind = event["type"]
                if kind == "input.text":
                    text = event.get("text")
                    if not isinstance(text, str):
                        raise invalid("'text' must be a string", "text", "invalid_type")
                    total_chars += len(text)
                    if total_chars > MAX_TEXT_CHARS_FACTOR * settings.max_input_chars:
                        raise APIError(413, f"the session's text exceeds "
                                            f"{MAX_TEXT_CHARS_FACTOR * settings.max_input_chars} characters",
                                       param="text", code="input_too_long")
                elif kind not in ("input.done", "input.cancel", "input.flush"):
                    raise invalid(f"unexpected message type {kind!r} (input.text, input.flush, input.done or "
                                  f"input.cancel)", "type", "invalid_value")
                await inbox.put(event)  # full: the socket is not read until the session loop takes one
        except WebSocketDisconnect:
            await inbox.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the session loop sends the error event
            await inbox.put(e)

    async def cancel_all(active) -> None:
        for s in active:
            s.task.cancel()
        await asyncio.gather(*(s.task for s in active), return_exceptions=True)

    async def run_session(ws, base: dict, speaker, stream_audio: bool, granularity: str, fmt: str,
                          sr_out: int) -> None:
        inbox: asyncio.Queue = asyncio.Queue(WS_INBOX_MAX)
        reader = asyncio.create_task(read_events(ws, inbox))
        active: collections.deque[_Sentence] = collections.deque()  # in order; the head is being sent
        pending: collections.deque[str] = collections.deque()  # complete sentences not started yet
        buffer, index, done = "", 0, False
        get_event = get_item = None
        play_start, sent_s = None, 0.0  # the listener's playback as the server sees it (from the first audio sent)
        last: _Sentence | None = None  # the sentence started last (the next one plays after it)

        def buffered() -> float:
            """Audio seconds sent and not yet played (a lower bound: the sentence being sent has more to come)."""
            return 0.0 if play_start is None else max(0.0, sent_s - (time.perf_counter() - play_start))

        async def send_audio(s: _Sentence, samples: np.ndarray) -> None:
            nonlocal play_start, sent_s
            data = raw_audio(samples, fmt)
            if data:
                await ws.send_bytes(data)
                s.sent += len(data)
                play_start = play_start or time.perf_counter()
                sent_s += samples.size / sr_out

        try:
            while True:
                while pending and len(active) <= settings.ws_lookahead:
                    # the sentence being sent waits for admission as any request; one ahead of it only takes a slot
                    # that is free now (else it starts when the current one is done, as without look-ahead)
                    if active and active[-1].handle is None:
                        break  # the runtime gets the sentences in order (the one before holds its ticket then)
                    ticket = state.try_admit() if active else None
                    if active and ticket is None:
                        break
                    s = _Sentence(index, pending.popleft())
                    index += 1
                    s.task = asyncio.create_task(synthesize(s, base, speaker, stream_audio, sr_out, ticket,
                                                            buffered(), last.handle if last is not None else None))
                    last = s
                    state.metrics.ws_event("sentences")
                    active.append(s)
                if done and not active:
                    break
                if get_event is None:
                    get_event = asyncio.create_task(inbox.get())
                if get_item is None and active:
                    get_item = asyncio.create_task(active[0].out.get())
                idle = None if active or pending else settings.ws_idle_timeout_s  # synthesis keeps a session open
                finished, _ = await asyncio.wait([t for t in (get_event, get_item) if t is not None], timeout=idle,
                                                 return_when=asyncio.FIRST_COMPLETED)
                if not finished:
                    raise idle_closed()
                if get_event.done():
                    event, get_event = get_event.result(), None
                    if event is None:
                        return  # the client left: the finally block cancels what runs
                    if isinstance(event, BaseException):
                        raise event
                    if event["type"] == "input.cancel":
                        if get_item is not None:
                            get_item.cancel()
                            get_item = None
                        cancelled = [s.index for s in active]
                        state.metrics.ws_event("cancels")
                        await cancel_all(active)
                        for s in active:
                            if s.announced:
                                await ws.send_json({"type": "audio.done", "sentence_index": s.index,
                                                    "total_bytes": s.sent, "error": False, "cancelled": True})
                        active.clear()
                        pending.clear()
                        buffer, last = "", None
                        play_start, sent_s = None, 0.0  # the client drops what it had (barge-in)
                        await ws.send_json({"type": "input.cancelled", "sentence_indices": cancelled})
                        continue
                    if done:
                        raise invalid(f"{event['type']!r} after input.done (only input.cancel may follow it)",
                                      "type", "invalid_value")
                    if event["type"] == "input.text":
                        buffer += event["text"]
                    elif event["type"] == "input.done":
                        done = True
                    sentences, buffer = take_complete(buffer, granularity,
                                                      final=done or event["type"] == "input.flush")
                    if len(buffer) > settings.max_input_chars:  # it could never be spoken as one sentence
                        raise invalid(f"the unfinished sentence is over {settings.max_input_chars} characters "
                                      f"(--max-input-chars): send sentence ends or input.flush", "text",
                                      "input_too_long")
                    pending.extend(sentences)
                if get_item is not None and get_item.done():
                    item, get_item = get_item.result(), None
                    s = active[0]
                    if isinstance(item, BaseException):
                        raise item
                    if item is _START:
                        s.announced = True
                        await ws.send_json({"type": "audio.start", "sentence_index": s.index,
                                            "sentence_text": s.text, "format": fmt, "sample_rate": sr_out})
                    elif item is _END:
                        if s.held:
                            await send_audio(s, np.concatenate(s.held))
                        await ws.send_json({"type": "audio.done", "sentence_index": s.index,
                                            "total_bytes": s.sent, "error": False})
                        active.popleft()
                    elif stream_audio:
                        await send_audio(s, item)
                    elif item.size:
                        s.held.append(item)
            await ws.send_json({"type": "session.done", "total_sentences": index})
            await ws.close(code=1000)
        finally:
            for t in (get_event, get_item, reader):
                if t is not None:
                    t.cancel()
            await cancel_all(active)

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(ws: WebSocket):
        if state.api_key is not None:
            try:
                state.check_auth(ws)
            except APIError:
                await ws.close(code=1008)  # before accept: the handshake is refused (HTTP 403)
                return
        await ws.accept()
        if state.ws_sessions >= settings.max_ws_sessions:
            state.metrics.ws_event("refused")
            await send_error(ws, APIError(429, f"{state.ws_sessions} websocket sessions are open (--max-ws-sessions "
                                               f"{settings.max_ws_sessions}): try again later",
                                          code="too_many_sessions"), close_code=1013)
            return
        state.ws_sessions += 1
        state.metrics.ws_event("opened")
        try:
            await session(ws)  # every send bounded by --send-timeout-s (app._Guard)
        except ClientStalled:  # nothing more can be sent; closing it could wait as long again
            state.metrics.ws_event("stalled")
            log.warning("websocket session dropped: the client took nothing for %g s", settings.send_timeout_s)
        finally:
            state.ws_sessions -= 1

    async def session(ws) -> None:
        try:
            state.check_serving()
            config = await receive_json(ws, settings.ws_idle_timeout_s)
            if config["type"] != "session.config":
                raise invalid("the first message must be {'type': 'session.config', ...}", "type", "invalid_value")
            stream_audio = config.get("stream_audio", False)
            granularity = config.get("split_granularity", "sentence")
            if not isinstance(stream_audio, bool):
                raise invalid("'stream_audio' must be true or false", "stream_audio", "invalid_type")
            if not isinstance(granularity, str) or granularity not in _ENDS:
                raise invalid("'split_granularity' must be 'sentence' or 'clause'", "split_granularity",
                              "unsupported_value")
            base = {k: v for k, v in config.items() if k not in CONFIG_KEYS}
            base.setdefault("model", settings.model)
            fmt = base.setdefault("response_format", "pcm")
            if fmt not in RAW_FORMATS:
                raise invalid(f"this stream sends raw sample frames: 'response_format' must be one of "
                              f"{', '.join(RAW_FORMATS)}", "response_format", "unsupported_value")
            for k in ("stream", "stream_format"):
                if k in base:
                    raise invalid(f"'{k}' is not a session field (use 'stream_audio')", k, "unknown_parameter")
            checked = parse_speech_request({**base, "input": "x"}, settings)  # the session's fields, checked once
            # its speaker, once (an inline reference decoded and embedded once, its errors before session.configured)
            speaker = await resolve_speaker(state, checked)
            base = {k: v for k, v in base.items() if k not in SPEAKER_KEYS}
            if stream_audio and checked.speed != 1.0:
                raise invalid("speed applies to whole sentences only: send stream_audio false or speed 1.0", "speed",
                              "unsupported_value")
            sr_out = checked.sample_rate or state.sample_rate
            await ws.send_json({"type": "session.configured", "session_id": f"ws-{uuid.uuid4().hex[:16]}",
                                "response_format": fmt, "stream_audio": stream_audio,
                                "split_granularity": granularity, "sample_rate": sr_out})
            await run_session(ws, base, speaker, stream_audio, granularity, fmt, sr_out)
        except WebSocketDisconnect:
            return  # the client left; run_session cancelled its sentences
        except (asyncio.CancelledError, ClientStalled):
            raise
        except Exception as e:  # noqa: BLE001 - an error event, then close
            try:
                await send_error(ws, e)
            except Exception:  # noqa: BLE001 - the socket is already gone
                pass
