"""The OpenAI-compatible speech server (`trtbuild serve`). FastAPI / uvicorn are imported only inside `create_app` /
`serve`.

    app.py            create_app (error handlers, Host check, HTTP counters) and serve (uvicorn)
    state.py          ServerState: settings, voices, pools, readiness, the auth / serving checks
    routes_speech.py  POST /v1/audio/speech -> speaker -> SpeechJob -> response
    routes_batch.py   POST /v1/audio/speech/batch (items with shared defaults, each failing alone)
    routes_ws.py      WS /v1/audio/speech/stream (text in pieces, audio per sentence)
    streaming.py      streamed bodies (chunked wav / pcm, SSE events)
    routes_voices.py  /v1/voices (alias /v1/audio/voices)
    routes_ops.py     /health, /metrics, /v1/models
    request.py        the speech body: bounded JSON, fields, vendor extras
    http.py           HTTP-only limits: capped / timed body reads, Content-Type, Host names
    jobs.py           SpeechJob: one runtime request per sentence, consumed in order
    settings.py, errors.py, encoding.py, metrics.py, voices.py, segments.py
Admission is the runtime's (TTS.admission, runtime/scheduling/admission.py); the server configures and asks it."""
from .app import create_app, serve
from .settings import ServerSettings, missing_serve_packages

__all__ = ["create_app", "serve", "ServerSettings", "missing_serve_packages"]
