"""`ServerSettings`: every knob of `trtbuild serve`, validated; and the `serve` extra's import check."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ...engines.errors import InputError

SERVE_PACKAGES = ((("fastapi",), "fastapi"), (("uvicorn",), "uvicorn"),
                  (("python_multipart", "multipart"), "python-multipart"), (("prometheus_client",), "prometheus-client"),
                  (("pydantic",), "pydantic"),
                  (("websockets", "wsproto"), "websockets"))  # (import names, pip name)
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerSettings:
    model: str = "tiny"
    engines: str | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_file: str | None = None  # read at start-up (so the key is not on the command line / in `ps`)
    voices_dir: str = field(default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "cosytrt",
                                                                 "voices"))
    max_input_chars: int = 4096
    max_upload_mb: float = 10.0
    max_in_flight: int = 8        # requests admitted to the runtime at once
    max_queue: int = 64           # requests waiting for a slot; beyond it: 429
    queue_timeout_s: float = 30.0  # longest wait for a slot; beyond it: 503
    drain_timeout_s: float = 30.0  # shutdown waits this long for in-flight requests
    warmup: bool = True
    warmup_tokens: int = 8
    log_level: str = "info"
    compile: bool = False          # torch.compile the LM and DiT at start-up (TTS.load(compile=True))
    compile_cache: str | None = None  # torch.compile artifacts to reuse / write (needs compile)
    # with compile: "whole" / "regional" DiT + LM compilation (default: whole), or "ar": the LM only
    compile_scope: str | None = None
    # --- hardening
    strict: bool = False           # reject unknown body fields (422-era behaviour) instead of the vendor allow-list
    allowed_hosts: list[str] | None = None  # Host header names accepted; None: the bound loopback names ("*": any)
    ref_audio_dir: str | None = None  # `ref_audio` may name files (file:// or absolute paths) under this folder
    ref_audio_hosts: list[str] | None = None  # `ref_audio` may be an http(s) URL on these hosts (None: no URLs)
    ref_audio_timeout_s: float = 10.0  # the whole fetch of a reference URL
    ref_audio_private_ok: bool = False  # let reference URLs resolve to loopback / private addresses (trusted LANs)
    max_voices: int = 1000         # stored voices at most (409 beyond)
    max_transcript_chars: int = 1000  # longest voice transcript (`text` / `ref_text`)
    max_prompt_seconds: float = 30.0  # longest reference audio, checked from the header before decoding
    max_sample_rate: int = 96000   # reference audio declaring a higher (or < 8 kHz) rate is refused
    max_channels: int = 2          # (30 s x 96 kHz x 2 ch: at most 23 MB of float32 per decode)
    body_timeout_s: float = 30.0   # the whole request body must arrive within this (408 then)
    send_timeout_s: float = 30.0   # a streamed response's client that takes no audio for this long is dropped
    max_json_depth: int = 32       # nesting depth of the JSON body
    normalize_text: bool = True    # numbers / dates / symbols -> words with wetext (when installed)
    stream_wav_sse: bool = False   # stream=true + wav (no stream_format): SSE events of WAV chunks (old sglang-omni)
    max_batch_items: int = 32      # items of one POST /v1/audio/speech/batch
    batch_parallel: int = 4        # items of one batch synthesised at once (the batch holds one admission slot)
    max_connections: int = 1024    # open connections at once (beyond: 503); each costs a socket and its buffers
    header_timeout_s: float = 10.0  # a connection whose request head has not arrived within this is closed
    max_segment_units: int = 80    # long input is split into sentences merged up to this many tokens (upstream 80)
    max_ws_sessions: int = 64      # open WS /v1/audio/speech/stream sessions at once (beyond: an error event, 1013)
    ws_idle_timeout_s: float = 60.0  # a session with nothing to synthesise and no message for this long is closed
    # sentences a websocket session synthesises ahead of the one it sends (0: none; off by default: on the CPU it
    # added stalls once synthesis was the bottleneck, BENCHMARKS.md thirteenth session; on an H100 below saturation
    # it cut sentence TTFA p95 0.95 -> 0.58 s, run 37: one run, one rate)
    ws_lookahead: int = 0
    ws_buffer_hints: bool = True   # a session's next sentence tells the runtime how much audio its listener still has
    # SchedulerConfig fields to set (`serve --scheduler NAME=VALUE`): booleans (0 / 1), numbers, strings; e.g.
    # ar_pace_lead_s=2, hift_own_stream=1, dit_max_wait_ms=2. Checked by name and type at start-up; the admission
    # limits have flags of their own (--max-in-flight, --max-queue, --queue-timeout-s)
    scheduler: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("max_input_chars", "max_in_flight", "port", "max_voices", "max_transcript_chars",
                     "max_sample_rate", "max_channels", "max_json_depth", "max_segment_units", "max_batch_items",
                     "max_ws_sessions", "batch_parallel", "max_connections"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "port" else 1):
                raise InputError(f"server setting {name} must be a positive integer, got {v!r}")
        if self.port > 65535:  # (0: any free port)
            raise InputError(f"server setting port must be a TCP port 0..65535, got {self.port}")
        if not isinstance(self.ws_lookahead, int) or isinstance(self.ws_lookahead, bool) or self.ws_lookahead < 0:
            raise InputError(f"server setting ws_lookahead must be a non-negative integer, got {self.ws_lookahead!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InputError(f"server setting max_queue must be a non-negative integer, got {self.max_queue!r}")
        for name in ("max_upload_mb", "queue_timeout_s", "drain_timeout_s", "max_prompt_seconds", "body_timeout_s",
                     "ref_audio_timeout_s", "ws_idle_timeout_s", "send_timeout_s", "header_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise InputError(f"server setting {name} must be a positive number, got {v!r}")
        if self.compile_scope is not None:
            from ..stages.compiled import COMPILE_CHOICES

            if self.compile_scope not in COMPILE_CHOICES:
                raise InputError(f"server setting compile_scope must be one of {', '.join(COMPILE_CHOICES)}; "
                                 f"got {self.compile_scope!r}")
            if not self.compile:
                raise InputError("server setting compile_scope needs compile (--compile)")
        self.scheduler = scheduler_overrides(self.scheduler)
        if self.allowed_hosts is not None:
            if isinstance(self.allowed_hosts, str):
                self.allowed_hosts = [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
            self.allowed_hosts = [str(h).lower() for h in self.allowed_hosts]
        if self.ref_audio_hosts is not None:
            if isinstance(self.ref_audio_hosts, str):
                self.ref_audio_hosts = [h.strip() for h in self.ref_audio_hosts.split(",") if h.strip()]
            self.ref_audio_hosts = [str(h).lower() for h in self.ref_audio_hosts]

    @property
    def upload_cap(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    def resolve_api_key(self) -> str | None:
        """The API key: `api_key`, else the first line of `api_key_file`, else $COSYTRT_API_KEY, else None."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            try:
                with open(os.path.expanduser(self.api_key_file), encoding="utf-8") as f:
                    key = f.readline().strip()
            except OSError as e:
                raise InputError(f"cannot read the API key file {self.api_key_file!r}: {e}") from None
            if not key:
                raise InputError(f"the API key file {self.api_key_file!r} is empty")
            return key
        return os.environ.get("COSYTRT_API_KEY") or None

    def host_names(self) -> list[str] | None:
        """Host header names to accept (without port), or None to accept any (bound to a wildcard or public
        address without `allowed_hosts`: DNS rebinding only matters for loopback-bound servers)."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else list(self.allowed_hosts)
        if self.host in LOOPBACK_HOSTS:
            return ["127.0.0.1", "localhost", "::1", "[::1]"]
        return None


_OWN_FLAGS = {"max_in_flight": "--max-in-flight", "max_waiting": "--max-queue", "submit_timeout_s": "--queue-timeout-s",
              "on_full": "--max-queue and --queue-timeout-s (the server waits, then answers 429 / 503)"}


def scheduler_overrides(items) -> dict:
    """`trtbuild serve --scheduler NAME=VALUE` (or a dict): `scheduling.config.config_overrides`, the admission
    limits excepted (they have flags of their own)."""
    from ..scheduling.config import config_overrides

    return config_overrides(items, "server setting scheduler",
                            {name: f"has its own flag, {flag}" for name, flag in _OWN_FLAGS.items()})


def missing_serve_packages() -> list[str]:
    """pip names of the `serve` extra's packages that are not importable."""
    import importlib.util

    return [pip for mods, pip in SERVE_PACKAGES if all(importlib.util.find_spec(m) is None for m in mods)]
