"""Every error cosytrt raises on bad input derives from CosytrtError and names the problem."""


class CosytrtError(Exception):
    """Base class: a clear, user-facing error (bad input, missing file, mismatch)."""


class ConfigError(CosytrtError):
    """A model config field is missing, malformed or unsupported."""


class CheckpointError(CosytrtError):
    """A checkpoint file is missing, or has a missing, unexpected or mis-shaped key."""


class ModelDirError(CosytrtError):
    """A model directory lacks a file it needs."""


class RequestTooLongError(CosytrtError):
    """A request needs more frames than the fixed noise buffers hold."""


class InputError(CosytrtError):
    """Bad request input: empty text, unreadable audio, prompt too long, ..."""


class ProfileError(CosytrtError):
    """A bucket profile YAML is malformed or contradictory."""


class BucketError(CosytrtError):
    """Unknown bucket, or no bucket fits."""


class EngineSetError(CosytrtError):
    """An engine set is missing, malformed, or does not match the model / backend."""


class BackendUnavailableError(CosytrtError):
    """A backend's package (tensorrt, tensorrt_llm, ...) is not installed."""

    def __init__(self, backend: str, package: str, detail: str = ""):
        self.backend = backend
        self.package = package
        msg = f"backend {backend!r} needs the Python package {package!r}, which is not installed"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class RejectedError(CosytrtError):
    """The runtime rejected a request (backpressure, shutdown, cancellation)."""


__all__ = ['CosytrtError', 'ConfigError', 'CheckpointError', 'ModelDirError', 'RequestTooLongError', 'InputError', 'ProfileError', 'BucketError', 'EngineSetError', 'BackendUnavailableError', 'RejectedError']
