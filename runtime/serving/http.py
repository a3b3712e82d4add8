"""HTTP-level limits and checks of the server, apart from synthesis: the capped, timed body read (413 / 408 / 429
for too many large uploads at once), the Content-Type check, the Host check's name parsing and the route labels of
the HTTP metrics. These limits are about HTTP and memory only; whether a request may use the runtime is decided by
the runtime's admission control (`TTS.admission`, runtime/scheduling/admission.py)."""
import asyncio
import contextvars
import logging
import re
import uuid

from .errors import APIError, invalid
from .jobs import _ClientGone

REQUEST_ID = contextvars.ContextVar("cosytrt_request_id", default="-")  # the current request's id (for logs)
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
BIG_BODY = 1 << 20  # bodies above 1 MiB (uploads, inline reference audio) are read a few at a time

ROUTES = ("/v1/audio/speech", "/v1/audio/speech/batch", "/v1/voices", "/v1/audio/voices", "/v1/models", "/health", "/metrics")


def request_id(headers) -> str:
    """The id a request is known by (response header `X-Request-Id`, server logs): the client's own `X-Request-Id`
    when it is a plain token of at most 128 characters (so a client or gateway can correlate), else a new one."""
    rid = next((v.decode("latin-1") for k, v in headers if k == b"x-request-id"), "")
    return rid if _REQUEST_ID_OK.fullmatch(rid) else f"req-{uuid.uuid4().hex}"


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (REQUEST_ID of the current context, "-" outside a request) to every log record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


async def read_body_capped(request, cap: int, what: str, timeout: float, big: asyncio.Semaphore | None = None) \
        -> bytes:
    """The request body, or 413 as soon as it is known to exceed `cap` bytes (Content-Length or while reading),
    408 when it does not arrive within `timeout` seconds, _ClientGone when the client disconnects. Bodies over
    BIG_BODY (or of unknown length) hold one of `big`'s slots while they are read (429 when none frees in time), so
    concurrent uploads cannot hold unbounded memory."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise invalid(f"bad Content-Length header {declared[:40]!r}", None, "bad_header") from None
        if n > cap:
            raise APIError(413, f"{what} is {n} bytes; at most {cap} are accepted", code="payload_too_large")

    async def read():
        parts, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > cap:
                raise APIError(413, f"{what} exceeds {cap} bytes", code="payload_too_large")
            parts.append(chunk)
        return b"".join(parts)

    held = False
    if big is not None and (declared is None or int(declared) > BIG_BODY):
        try:
            await asyncio.wait_for(big.acquire(), timeout)
        except asyncio.TimeoutError:
            raise APIError(429, "too many large uploads in progress", code="too_many_requests",
                           headers={"Retry-After": "1"}) from None
        held = True
    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"{what} did not arrive within {timeout:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise _ClientGone from None
    finally:
        if held:
            big.release()


def check_content_type(request, *allowed: str) -> None:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in allowed:
        raise APIError(415, f"Content-Type must be {' or '.join(allowed)}, got {ctype or 'none'!r}",
                       code="unsupported_media_type")


def route_label(path: str) -> str:
    if path.startswith(("/v1/voices/", "/v1/audio/voices/")):
        return "/v1/voices/{id}"
    return path if path in ROUTES else "other"


def host_name(host: str) -> str:
    """A Host header's name without the port ('[::1]:8000' -> '[::1]')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


async def until_done_or_gone(coro, request):
    """Await `coro`, but give up (cancel it, raise _ClientGone) when the client disconnects first."""
    task = asyncio.ensure_future(coro)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise _ClientGone
    return task.result()
