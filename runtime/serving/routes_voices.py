"""Voice routes: `GET` / `POST /v1/voices` (alias `/v1/audio/voices`) list and create stored voices from an uploaded
reference clip (multipart: `audio` or `audio_sample`, `text` or `ref_text`, `name`), `DELETE /v1/voices/{id}`."""
import asyncio
import os
import uuid

from ...engines.errors import CosytrtError, InputError
from .errors import APIError, from_runtime_error, invalid
from .http import check_content_type, read_body_capped
from .voices import VoiceExistsError, VoiceLimitError, VoiceNotFoundError, check_voice_id


async def read_form(request, data: bytes, cap: int):
    """The multipart form of an already-read (capped) body."""
    from fastapi import Request

    replayed = False

    async def replay():
        nonlocal replayed
        if replayed:
            return {"type": "http.disconnect"}
        replayed = True
        return {"type": "http.request", "body": data, "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=2, max_fields=8, max_part_size=cap)
    except Exception as e:  # noqa: BLE001 - malformed multipart
        raise invalid(f"the body must be multipart/form-data with an 'audio' file: {e}", "audio",
                      "invalid_multipart") from None


def add_voice_routes(app, state) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    settings, tts = state.settings, state.tts

    async def list_voices(request: Request):
        state.check_auth(request)
        voices = await asyncio.get_running_loop().run_in_executor(None, state.voices.list)
        return {"object": "list", "data": [v.to_dict() for v in voices],
                "voices": [v.id for v in voices]}  # "voices": the plain id list some clients read

    async def create_voice(request: Request):
        state.check_auth(request)
        state.check_serving()
        check_content_type(request, "multipart/form-data")
        cap = settings.upload_cap
        data = await read_body_capped(request, cap, "the upload", settings.body_timeout_s, state.big_bodies)
        form = await read_form(request, data, cap)
        # field names of OpenAI-style clients and of sglang-omni's harness (audio_sample / ref_text)
        upload = form.get("audio") if form.get("audio") is not None else form.get("audio_sample")
        text = form.get("text") if form.get("text") is not None else form.get("ref_text")
        name = form.get("name")
        if upload is None:
            raise invalid("'audio' (the reference audio file) is required", "audio", "missing_required")
        if isinstance(upload, str):
            raise invalid("'audio' must be a file upload", "audio", "invalid_type")
        for field_name, v in (("text", text), ("name", name)):
            if v is not None and not isinstance(v, str):
                raise invalid(f"'{field_name}' must be a text field", field_name, "invalid_type")
        if text is not None and len(text) > settings.max_transcript_chars:
            raise invalid(f"'text' is {len(text)} characters; at most {settings.max_transcript_chars}", "text",
                          "transcript_too_long")
        voice_id = name if name is not None else f"voice-{uuid.uuid4().hex[:12]}"
        try:
            check_voice_id(voice_id)
        except InputError as e:
            raise invalid(str(e), "name") from None
        if voice_id == "default" or os.path.exists(state.voices.path(voice_id)):
            raise from_runtime_error(VoiceExistsError(f"voice {voice_id!r} already exists"))
        if state.voices.max_voices is not None and state.voices.count() >= state.voices.max_voices:
            raise from_runtime_error(VoiceLimitError(f"the server stores at most {state.voices.max_voices} voices; "
                                                     f"delete one first"))
        raw = await upload.read()
        loop = asyncio.get_running_loop()
        samples, sr = await loop.run_in_executor(state.decoder, state.decode, raw, "audio")
        try:
            async with state.admitted("voice upload"):  # the speaker extraction runs the frontend models
                speaker = await loop.run_in_executor(None, lambda: tts.make_speaker(samples, text or "", sr))
            info = await loop.run_in_executor(None, state.voices.add, voice_id, speaker)
        except CosytrtError as e:
            raise from_runtime_error(e, param="name" if isinstance(e, (VoiceExistsError, VoiceLimitError)) else
                                     "audio") from None
        return JSONResponse(info.to_dict(), status_code=201)

    async def delete_voice(voice_id: str, request: Request):
        state.check_auth(request)
        try:
            check_voice_id(voice_id)
            state.voices.delete(voice_id)
        except VoiceExistsError as e:
            raise APIError(409, str(e), param="voice_id", code="voice_builtin") from None
        except VoiceNotFoundError as e:
            raise APIError(404, str(e), param="voice_id", code="voice_not_found") from None
        except InputError as e:
            raise invalid(str(e), "voice_id") from None
        return {"id": voice_id, "object": "voice", "deleted": True}

    for prefix in ("/v1/voices", "/v1/audio/voices"):
        app.add_api_route(prefix, list_voices, methods=["GET"])
        app.add_api_route(prefix, create_voice, methods=["POST"], status_code=201)
        app.add_api_route(prefix + "/{voice_id}", delete_voice, methods=["DELETE"])
