"""`trtbuild serve`: the OpenAI-compatible speech server (needs the `serve` extra: fastapi, uvicorn,
python-multipart)."""
from __future__ import annotations

import sys

from ._cli import add_device, port_arg


def add_arguments(p) -> None:
    from ..runtime.stages.compiled import COMPILE_CHOICES

    p.add_argument("--model", default="tiny", help="'tiny' (embedded default) or a CosyVoice3 model directory")
    p.add_argument("--engines", default=None, help="engine set folder built by `trtbuild build` (default: eager)")
    add_device(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=port_arg, default=8000, help="TCP port 1..65535 (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: no key; also $COSYTRT_API_KEY)")
    p.add_argument("--voices-dir", default=None, help="folder of saved voices (default ~/.cache/cosytrt/voices)")
    p.add_argument("--max-input-chars", type=int, default=4096, help="longest accepted 'input' text")
    p.add_argument("--max-upload-mb", type=float, default=10.0, help="largest accepted voice upload, in MiB")
    p.add_argument("--max-in-flight", type=int, default=8, help="requests synthesized at once")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot (429 beyond)")
    p.add_argument("--queue-timeout-s", type=float, default=30.0, help="longest wait for a slot (503 then)")
    p.add_argument("--drain-timeout-s", type=float, default=30.0, help="shutdown waits this long for requests")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the LM and DiT at start-up (minutes on a cold cache; faster serving)")
    p.add_argument("--compile-scope", default=None, choices=list(COMPILE_CHOICES),
                   help="with --compile: the DiT and LM compiled as whole graphs (default) or one block / layer "
                        "reused by all (regional: a shorter compile; on an H100 the same open-loop throughput as "
                        "whole), or the LM only (ar: the DiT / HiFT as eager modules in CUDA graphs: 16-19 %% less "
                        "throughput near saturation, BENCHMARKS.md runs 42-43)")
    p.add_argument("--compile-cache", default=None, metavar="FILE",
                   help="with --compile: reuse / write torch.compile's artifacts in FILE (fast restarts)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="read the API key from the first line of FILE (keeps it out of `ps`)")
    p.add_argument("--strict", action="store_true",
                   help="reject every unknown request field (default: accept the vendor extras peers send)")
    p.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host header names served (default: the loopback names when bound to loopback; '*': any)")
    p.add_argument("--ref-audio-dir", default=None, metavar="DIR",
                   help="let 'ref_audio' name files (file:// or absolute paths) inside DIR (default: none)")
    p.add_argument("--ref-audio-hosts", default=None, metavar="H1,H2",
                   help="let 'ref_audio' be an http(s) URL on these hosts ('*.example.com': its subdomains); public "
                        "addresses only, no redirects, --max-upload-mb and --ref-audio-timeout apply (default: none)")
    p.add_argument("--ref-audio-timeout", dest="ref_audio_timeout_s", type=float, default=10.0, metavar="S",
                   help="longest fetch of a reference audio URL")
    p.add_argument("--ref-audio-private-ok", action="store_true",
                   help="let reference URLs resolve to loopback / private addresses (a trusted network only)")
    p.add_argument("--stream-wav-sse", action="store_true",
                   help="answer stream=true + wav requests (no stream_format) with SSE events each carrying one WAV "
                        "chunk, as older sglang-omni seedtts --stream clients read (default: a chunked WAV)")
    p.add_argument("--max-voices", type=int, default=1000, help="stored voices at most")
    p.add_argument("--max-transcript-chars", type=int, default=1000, help="longest voice transcript")
    p.add_argument("--body-timeout-s", type=float, default=30.0, help="the request body must arrive within this")
    p.add_argument("--send-timeout-s", type=float, default=30.0,
                   help="drop a streamed response or websocket session whose client takes no data for this long")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections at once (beyond: 503 Service Unavailable)")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="close a connection whose request head has not arrived within this many seconds")
    p.add_argument("--batch-parallel", type=int, default=4,
                   help="items of one /v1/audio/speech/batch request synthesised at once")
    p.add_argument("--max-ws-sessions", type=int, default=64,
                   help="open websocket sessions (WS /v1/audio/speech/stream) at once; beyond: an error event")
    p.add_argument("--ws-idle-timeout-s", type=float, default=60.0,
                   help="close a websocket session with nothing to synthesise and no message for this long")
    p.add_argument("--ws-lookahead", type=int, default=0,
                   help="sentences a websocket session synthesises ahead of the one it sends (default 0: none)")
    p.add_argument("--no-ws-buffer-hints", action="store_true",
                   help="do not tell the runtime how much audio a websocket listener still has when a session's next "
                        "sentence starts (it then counts as urgent as a new session's first)")
    p.add_argument("--scheduler", action="append", default=[], metavar="NAME=VALUE",
                   help="set a SchedulerConfig field (repeatable), e.g. ar_pace_lead_s=2 or dit_max_wait_ms=2: "
                        "booleans as 0 / 1, numbers, strings; checked at start-up")
    p.add_argument("--no-normalize", action="store_true",
                   help="do not spell out numbers / dates / symbols (wetext) before synthesis")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--cluster", default=None, choices=["ray"],
                   help="run the stages as Ray Serve deployments (needs the 'cluster' extra: pip install "
                        "'cosytrt[cluster]')")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="with --cluster ray: placement / sizing YAML (e.g. profiles/cluster-example.yaml); its "
                        "'server' section overrides the flags above (default: one CPU replica per stage)")


def run(args) -> int:
    import os

    from ..runtime.serving import ServerSettings, missing_serve_packages, serve

    missing = missing_serve_packages()
    if missing:
        print(f"trtbuild serve: error: the server needs the Python package(s) {', '.join(missing)}, which are not "
              f"installed (pip install 'cosytrt[serve]')", file=sys.stderr)
        return 2
    if args.cluster is None and args.config is not None:
        print("trtbuild serve: error: --config is the cluster placement file: it needs --cluster ray", file=sys.stderr)
        return 2
    if args.cluster == "ray":
        from ..runtime.cluster.app import CLUSTER_EXTRA, missing_cluster_packages

        missing = missing_cluster_packages()
        if missing:
            print(f"trtbuild serve: error: --cluster ray needs the Python package {', '.join(missing)} (Ray Serve), "
                  f"which is not installed (pip install '{CLUSTER_EXTRA}')", file=sys.stderr)
            return 2
        if args.engines is not None or args.device != "cpu":
            print("trtbuild serve: error: with --cluster ray, engines and devices are set per stage in the cluster "
                  "config (--config FILE)", file=sys.stderr)
            return 2
    kw = {}
    if args.voices_dir:
        kw["voices_dir"] = args.voices_dir
    settings = ServerSettings(model=args.model, engines=args.engines, device=args.device, host=args.host,
                              port=args.port, api_key=args.api_key or os.environ.get("COSYTRT_API_KEY") or None,
                              max_input_chars=args.max_input_chars, max_upload_mb=args.max_upload_mb,
                              max_in_flight=args.max_in_flight, max_queue=args.max_queue,
                              queue_timeout_s=args.queue_timeout_s, drain_timeout_s=args.drain_timeout_s,
                              log_level=args.log_level, compile=args.compile, compile_cache=args.compile_cache,
                              compile_scope=args.compile_scope,
                              api_key_file=args.api_key_file, strict=args.strict,
                              allowed_hosts=args.allowed_hosts, ref_audio_dir=args.ref_audio_dir,
                              ref_audio_hosts=args.ref_audio_hosts, ref_audio_timeout_s=args.ref_audio_timeout_s,
                              ref_audio_private_ok=args.ref_audio_private_ok, stream_wav_sse=args.stream_wav_sse,
                              max_voices=args.max_voices, max_transcript_chars=args.max_transcript_chars,
                              body_timeout_s=args.body_timeout_s, send_timeout_s=args.send_timeout_s,
                              max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
                              batch_parallel=args.batch_parallel,
                              normalize_text=not args.no_normalize,
                              max_ws_sessions=args.max_ws_sessions, ws_idle_timeout_s=args.ws_idle_timeout_s,
                              ws_lookahead=args.ws_lookahead, ws_buffer_hints=not args.no_ws_buffer_hints,
                              scheduler=args.scheduler, **kw)
    if args.cluster is None:
        _print_model_hashes(args.model)
    if args.cluster == "ray":
        from ..runtime.cluster.app import serve_cluster

        return serve_cluster(args.config, settings)
    return serve(settings)


def _print_model_hashes(model: str) -> None:
    """Start-up line: the sha256 of the model's checkpoints and ONNX frontends (cached: the load re-uses them)."""
    from ..runtime.models.loading import model_file_hashes, resolve_source

    _, d, _ = resolve_source(model)
    parts = ", ".join(f"{k} {v[:16]}" for k, v in model_file_hashes(d).items())
    print(f"trtbuild serve: model {d}: sha256 {parts}", file=sys.stderr, flush=True)
