"""Operations routes: `GET /health` (200 once loaded and warmed, 503 while loading / draining / after the runtime
died), `GET /metrics` (Prometheus text) and `GET /v1/models`."""


def add_ops_routes(app, state) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    @app.get("/health")
    async def health():
        body, ok = state.health_body()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        adm = state.admission
        text = state.metrics.render(in_flight=adm.in_flight if adm else 0, queued=adm.waiting if adm else 0,
                                    ready=state.ready, runtime_stats=state.runtime_stats(),
                                    ws_sessions=state.ws_sessions)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        return {"object": "list", "data": [{"id": state.settings.model, "object": "model", "created": 0,
                                            "owned_by": "cosytrt"}]}
