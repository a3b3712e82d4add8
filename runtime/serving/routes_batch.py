"""`POST /v1/audio/speech/batch`: several speech requests in one JSON call, as sglang-omni's serving harness
(benchmarks/tts_serving) sends them: top-level fields are defaults for every item of `items` (an item's own fields
win); each item is validated and synthesised on its own (all of them at once, so the runtime batches them) and fails
alone. The answer:

    {"id": "batch-…", "object": "speech.batch", "total": N, "succeeded": S, "failed": F,
     "results": [{"index": 0, "status": "ok", "media_type": "audio/wav", "audio_data": "<base64>"},
                 {"index": 1, "status": "error", "error": {"message", "type", "param", "code", "status"}}, …]}

The whole batch takes one admission slot (its items run under that ticket); streaming items are refused per item."""
import asyncio
import base64
import uuid

import numpy as np

from .encoding import MEDIA_TYPES, encode_at
from .errors import APIError, from_runtime_error, invalid
from .http import check_content_type, read_body_capped, until_done_or_gone
from .jobs import SpeechJob, _ClientGone, segments, tracked_job
from .routes_speech import resolve_speaker


async def synthesize_item(state, params, ticket) -> dict:
    """One batch item -> its result entry (raises APIError / runtime errors on failure)."""
    if params.stream:
        raise invalid("batch items cannot stream; leave 'stream' / 'stream_format' out", "stream",
                      "unsupported_value")
    tts, settings = state.tts, state.settings
    speaker = await resolve_speaker(state, params)
    options = {"speaker": speaker, **params.options, **state.lease(ticket)}
    if params.speed != 1.0:
        options["speed"] = params.speed
    job = SpeechJob(tts, await segments(state, params.input, params.options, speaker), options, False)
    async with tracked_job(state, job, ticket):
        parts = [c async for c in job.chunks()]
    wav = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    sr = params.sample_rate or state.sample_rate
    data = await asyncio.get_running_loop().run_in_executor(None, encode_at, wav, state.sample_rate, sr,
                                                            params.response_format)
    return {"status": "ok", "media_type": MEDIA_TYPES[params.response_format],
            "audio_data": base64.b64encode(data).decode("ascii"),
            "audio_seconds": round(wav.size / state.sample_rate, 4), "sample_rate": sr}


def item_error(e: BaseException) -> dict:
    err = from_runtime_error(e)
    return {"status": "error", "error": {**err.body()["error"], "status": err.status}}


def add_batch_routes(app, state) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from .request import load_json, parse_speech_request

    settings = state.settings

    @app.post("/v1/audio/speech/batch")
    async def speech_batch(request: Request):
        state.check_auth(request)
        state.check_serving()
        check_content_type(request, "application/json")
        n_max = settings.max_batch_items
        cap = max(65536, n_max * (8 * settings.max_input_chars + 4096), (settings.upload_cap * 4) // 3 + 8192)
        raw = await read_body_capped(request, cap, "the request body", settings.body_timeout_s, state.big_bodies)
        body = await asyncio.get_running_loop().run_in_executor(state.decoder, load_json, raw, settings)
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object with 'items'", "body", "invalid_type")
        items = body.get("items")
        if not isinstance(items, list) or not items:
            raise invalid("'items' must be a non-empty list of speech requests", "items", "invalid_value")
        if len(items) > n_max:
            raise invalid(f"'items' has {len(items)} entries; at most {n_max} per batch", "items", "batch_too_large")
        defaults = {k: v for k, v in body.items() if k != "items"}
        parsed: list = []
        for item in items:
            try:
                if not isinstance(item, dict):
                    raise invalid("each item must be a JSON object", "items", "invalid_type")
                parsed.append(parse_speech_request({**defaults, **item}, settings))
            except APIError as e:
                parsed.append(e)
        try:  # one slot for the batch (a client gone while it waits leaves the queue); its items run under it,
            ticket = await until_done_or_gone(state.admit("speech batch"), request)
        except _ClientGone:
            from fastapi.responses import Response

            return Response(status_code=499)
        running = asyncio.Semaphore(settings.batch_parallel)  # at most this many at once (one slot: bounded work)
        try:
            async def run(p):
                if isinstance(p, BaseException):
                    return item_error(p)
                try:
                    async with running:
                        return await synthesize_item(state, p, ticket)
                except Exception as e:  # noqa: BLE001 - this item fails alone
                    return item_error(e)

            results = await until_done_or_gone(asyncio.gather(*(run(p) for p in parsed)), request)
        except _ClientGone:
            from fastapi.responses import Response

            return Response(status_code=499)  # nobody reads it; counted as "client closed request"
        finally:
            state.release(ticket)
        results = [{"index": i, **r} for i, r in enumerate(results)]
        ok = sum(r["status"] == "ok" for r in results)
        return JSONResponse({"id": f"batch-{uuid.uuid4().hex[:16]}", "object": "speech.batch", "total": len(results),
                             "succeeded": ok, "failed": len(results) - ok, "results": results})
