"""OpenAI-shaped HTTP errors: {"error": {"message", "type", "param", "code"}}, and the runtime's errors mapped to them.

Status codes follow OpenAI's API: 400 invalid request, 401 bad key, 404 unknown voice / route, 405, 408 body too
slow, 409 voice exists, 413 too large, 415 wrong content type, 421 wrong Host, 429 busy, 500 internal, 503 not
ready / queue timeout / shutting down."""
from __future__ import annotations

import logging

from ...engines.errors import CosytrtError, RejectedError, RequestTooLongError
from ..scheduling.admission import AdmissionTimeoutError, OverloadedError, QueueFullError
from .voices import VoiceExistsError, VoiceLimitError, VoiceNotFoundError

log = logging.getLogger("cosytrt.server")


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("server_error" if status >= 500 else "rate_limit_error" if status == 429 else
                             "authentication_error" if status == 401 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """400 invalid_request_error naming the field."""
    return APIError(400, message, param=param, code=code)


def from_runtime_error(e: BaseException, param: str | None = None) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, VoiceNotFoundError):
        return APIError(404, str(e), param=param or "voice", code="voice_not_found")
    if isinstance(e, VoiceLimitError):
        return APIError(409, str(e), param=param or "name", code="voice_limit")
    if isinstance(e, VoiceExistsError):
        return APIError(409, str(e), param=param or "name", code="voice_exists")
    if isinstance(e, RequestTooLongError):
        return APIError(413, str(e), param="input", code="request_too_long")
    # the runtime's admission control (scheduling/admission.py) refused: busy (429) or no slot in time (503)
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), code="too_many_requests", headers={"Retry-After": "1"})
    if isinstance(e, AdmissionTimeoutError):
        return APIError(503, str(e), code="queue_timeout", headers={"Retry-After": "1"})
    if isinstance(e, OverloadedError):  # load shedding (shed_lag_s): the streams in flight are behind
        return APIError(503, str(e), code="overloaded", headers={"Retry-After": "2"})
    if isinstance(e, RejectedError):
        return APIError(429, f"the runtime is at capacity: {e}", code="overloaded", headers={"Retry-After": "1"})
    if isinstance(e, CosytrtError):
        return APIError(400, str(e), param=param, code="invalid_value")
    log.error("internal error: %s: %s", type(e).__name__, e, exc_info=e)
    # the runtime's own failure (e.g. a dead replica) is named; client input never gets here (it is a 4xx)
    return APIError(500, f"internal error: {type(e).__name__}: {str(e)[:500]}", code="internal_error")
