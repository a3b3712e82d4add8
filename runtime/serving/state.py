"""`ServerState`: what one server process holds over its shared `TTS` — settings, API key, voices, metrics, the
thread pools that keep blocking work off the event loop, readiness (warm-up, drain, runtime health), the checks
every route runs first (API key, serving), and the way to the runtime's admission control (`admit`)."""
import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from ..scheduling.admission import AdmissionControl, Ticket
from .encoding import decode_upload, ref_audio_bytes
from .errors import APIError, from_runtime_error
from .jobs import SpeechJob
from .metrics import ServerMetrics
from .settings import ServerSettings
from .voices import VoiceStore

log = logging.getLogger("cosytrt.server")


class ServerState:
    def __init__(self, tts, settings: ServerSettings, owns_tts: bool):
        self.tts = tts
        self.settings = settings
        self.owns_tts = owns_tts
        self.api_key = settings.resolve_api_key()
        self.metrics = ServerMetrics()
        self.voices = VoiceStore(settings.voices_dir, getattr(getattr(tts, "pipeline", None), "default_speaker",
                                                              None), max_voices=settings.max_voices)
        # submit() may block while the runtime is full: never on the event loop, and never on the default pool
        self.executor = ThreadPoolExecutor(max_workers=settings.max_in_flight + 1, thread_name_prefix="cosytrt-submit")
        # decoding uploads: its own small pool, so a flood of uploads cannot take the submit threads
        self.decoder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cosytrt-decode")
        # admission is the runtime's (TTS.admission: the same control its scheduler admits through); the server
        # configures it with its flags at start-up (restored at shutdown) and asks it for every speech request and
        # voice upload. A TTS stand-in without one (tests) gets one here.
        own = getattr(tts, "admission", None)
        self.tts_admits = isinstance(own, AdmissionControl)
        self.admission = own if self.tts_admits else AdmissionControl(settings.max_in_flight, settings.max_queue,
                                                                      settings.queue_timeout_s)
        self._limits_before: dict | None = None
        self.ws_sessions = 0  # open websocket sessions (routes_ws.py; bounded by settings.max_ws_sessions)
        self.tickets: set[Ticket] = set()  # held by this server's requests (drain waits for them)
        self.warmed = False
        self.status = "loading"
        self.error: str | None = None
        self.draining = False
        self.jobs: set[SpeechJob] = set()
        # HTTP-level memory bound (not admission): large bodies (uploads, inline references) read at once
        self.big_bodies = asyncio.Semaphore(max(2, settings.max_in_flight))

    # ------------------------------------------------------------------ readiness
    @property
    def ready(self) -> bool:
        return self.warmed and not self.draining and self.runtime_health()[0]

    def runtime_health(self) -> tuple[bool, str | None]:
        health = getattr(self.tts, "health", None)
        if health is None:
            return True, None
        try:
            return health()
        except Exception as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {e}"

    def health_body(self) -> tuple[dict, bool]:
        ok, why = self.runtime_health()
        if self.warmed and not self.draining and not ok:
            return {"status": "failed", "error": f"the runtime stopped: {why}"}, False
        body = {"status": self.status}
        if self.error:
            body["error"] = self.error
        return body, self.ready

    # ------------------------------------------------------------------ checks every route runs first
    def check_auth(self, request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or incorrect API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        ok, why = self.runtime_health()
        if not ok:
            raise APIError(503, f"the runtime stopped: {why}", code="runtime_failed")
        if not self.ready:
            raise APIError(503, f"the model is not ready ({self.status})", code="not_ready",
                           headers={"Retry-After": "1"})

    # ------------------------------------------------------------------ admission (the runtime's)
    def configure_admission(self) -> None:
        s = self.settings
        self._limits_before = self.admission.configure(max_in_flight=s.max_in_flight, max_waiting=s.max_queue,
                                                       timeout_s=s.queue_timeout_s, on_full="wait")

    async def admit(self, what: str, shed: bool = True) -> Ticket:
        """A ticket from the runtime's admission control; its refusals as OpenAI-shaped errors (429 busy, 503 no
        slot in time or overloaded). `shed` False: not refused by load shedding (a conversation's next sentence)."""
        try:
            ticket = await self.admission.admit_async(what, shed=shed)
        except Exception as e:  # noqa: BLE001 - RejectedError subclasses
            raise from_runtime_error(e) from None
        self.tickets.add(ticket)
        return ticket

    def try_admit(self) -> Ticket | None:
        """A ticket only if one is free at once (optional work: a websocket session's next sentence ahead)."""
        ticket = self.admission.try_admit()
        if ticket is not None:
            self.tickets.add(ticket)
        return ticket

    def release(self, ticket: Ticket) -> None:
        self.tickets.discard(ticket)
        ticket.release()

    def lease(self, ticket: Ticket) -> dict:
        """The submit option running a runtime request under `ticket` (none for a stand-in without admission)."""
        return {"lease": ticket} if self.tts_admits else {}

    @asynccontextmanager
    async def admitted(self, what: str):
        """`async with state.admitted("voice upload"):` runtime work that is not a speech job."""
        ticket = await self.admit(what)
        try:
            yield ticket
        finally:
            self.release(ticket)

    # ------------------------------------------------------------------ runtime views
    @property
    def sample_rate(self) -> int:
        return int(self.tts.sample_rate)

    def runtime_stats(self) -> dict | None:
        try:
            stats = self.tts.metrics()
            return stats if isinstance(stats, dict) else None
        except Exception:  # noqa: BLE001 - metrics must never break /metrics
            log.exception("tts.metrics() failed")
            return None

    def ref_audio_bytes(self, value: str, param: str = "ref_audio") -> bytes:
        """An inline reference's bytes: data: URI / base64, a file under --ref-audio-dir, or an http(s) URL on
        --ref-audio-hosts (fetch.py's rules). Blocking: run it on `self.decoder`."""
        s = self.settings
        if isinstance(value, str) and value[:8].lower().startswith(("http://", "https://")):
            from .fetch import fetch_ref_audio

            return fetch_ref_audio(value, allowed_hosts=s.ref_audio_hosts, cap=s.upload_cap,
                                   timeout=s.ref_audio_timeout_s, private_ok=s.ref_audio_private_ok, param=param)
        return ref_audio_bytes(value, ref_dir=s.ref_audio_dir, cap=s.upload_cap, param=param)

    async def load_json(self, raw: bytes):
        """`request.load_json` of a body or websocket message; over `http.BIG_BODY` (an inline reference) off the
        event loop, on `self.decoder`."""
        from .http import BIG_BODY
        from .request import load_json

        if len(raw) > BIG_BODY:
            return await asyncio.get_running_loop().run_in_executor(self.decoder, load_json, raw, self.settings)
        return load_json(raw, self.settings)

    def decode(self, data: bytes, param: str):
        """Reference audio bytes -> (samples, rate), bounded by the settings (run it on `self.decoder`)."""
        s = self.settings
        return decode_upload(data, max_seconds=s.max_prompt_seconds, max_sample_rate=s.max_sample_rate,
                             max_channels=s.max_channels, param=param)

    # ------------------------------------------------------------------ start-up / shutdown
    async def warm_up(self) -> None:
        try:
            speaker = self.voices.builtin
            if speaker is None:
                from ..stages.request import default_voice_wav

                speaker = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.tts.make_speaker(default_voice_wav(16000), "", 16000))
            if self.settings.warmup:
                t0 = time.perf_counter()
                job = SpeechJob(self.tts, ["Warm up."], {"speaker": speaker, "seed": 0,
                                                         "max_tokens": self.settings.warmup_tokens}, False)
                await job.start(self.executor)
                async for _ in job.chunks():
                    pass
                log.info("warm-up synthesis took %.2f s", time.perf_counter() - t0)
            self.warmed, self.status = True, "ready"
        except Exception as e:  # noqa: BLE001 - reported by /health
            log.exception("warm-up failed")
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"

    async def drain(self) -> None:
        self.draining, self.status = True, "draining"
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self.tickets and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self.jobs):
            job.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.decoder.shutdown(wait=False, cancel_futures=True)
        if self._limits_before:  # a TTS shared with other users gets its own limits back
            self.admission.configure(**self._limits_before)
            self._limits_before = None
        if self.owns_tts:
            await asyncio.get_running_loop().run_in_executor(None, self.tts.close)
