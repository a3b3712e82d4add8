"""What runs inside the AR's own process (`SchedulerConfig.ar_process`; the parent's side is `ar_process.py`).

The child holds a copy of the LM (the parent's weights, bit for bit) and the AR runner (KV slots, decode / prefill
graphs, compile), and runs the same `ARWorker` as one process does. Its main thread reads the parent's messages (a
request's LM inputs, cancels, a scheduler's attach / detach, stats); the AR thread decodes and hands each request's
new tokens back at the points the token2wav side can use them (a streaming request's hop points, the end) — one
message per AR step at most. Why a process: the AR's per-step Python then no longer waits for the interpreter lock
behind the DiT, vocoder, frontend and server threads (BENCHMARKS.md run 68: a 6.45 ms step for ~1.3 ms of kernels).

Each scheduler over the parent's `ARProcess` is a session here (`sid`): its own AR worker and thread over the one
runner, whose steps the workers take in turn (`ar_worker.step_lock`). Request keys are the parent's, unique across
sessions.

Messages (pickled tuples, `send` / `recv` below): parent -> child
    ("attach", call, sid, config)  ("detach", call, sid)
    ("submit", sid, key, request, inputs, noise_room, t_submit, t_tokenizer)  ("cancel", key)
    ("stats", call, sid)  ("save_cache", call, path)  ("close",)
child -> parent
    ("ready", info) | ("failed", error)      once, after the runner is built
    ("tokens", sid, [(key, ids, done, metrics | None), ...])  ("fail", sid, key, error)  ("died", sid, reason)
    ("reply", call, value) | ("reply_error", call, error)
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import threading

import numpy as np
import torch

from ...engines.errors import RejectedError
from ..stages.request import RequestMetrics
from .ar_runners import enable_for, torch_ar_runner
from .ar_worker import ARWorker, Stopped, runner_stats
from .handle import RequestHandle
from .prepare import ar_side
from .stage_clock import StageClock
from .state import RequestState


def send(conn, msg) -> None:
    """One message over the pipe (both sides): a pickled tuple."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def portable_error(e: BaseException) -> BaseException:
    """`e` if it survives pickling (the runtime's own errors do), else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any exception type may come
        return RuntimeError(f"{type(e).__name__}: {e}")


def rebuild_lm(lm_class, lm_config, state: bytes, dtype, device, attrs: dict):
    """The parent's LM in this process: built from its config on `device`, its weights loaded from `state` (the
    parent's tensors as `torch.save` wrote them: exactly), then the attributes the scheduler set on it (`attrs`)."""
    with torch.device(device):
        lm = lm_class(lm_config)
    lm.to(dtype=dtype)
    lm.load_state_dict(torch.load(io.BytesIO(state), map_location="cpu", weights_only=True), strict=True)
    lm.eval().requires_grad_(False)
    for k, v in attrs.items():
        setattr(lm, k, v)
    return lm


class _PipeSink:
    """A session's AR worker's token sink: new tokens collected per step (at a stream's hop points and at the end, as
    the cluster's `TokenStream` flushes them), sent to the parent in one message by `flush`."""

    def __init__(self, child: "_Child", sid: int):
        self.child, self.sid = child, sid
        self.items: list = []

    def tokens(self, r: RequestState, done: bool) -> None:
        key = self.child.key_of(r)
        if key is None:
            return
        ids = r.take_flushed(done)
        ids = None if ids is None else np.asarray(ids, dtype=np.int64)
        if done:
            m = r.metrics
            self.items.append((key, ids, True, {"t_ar": m.t_ar, "t_queue": m.t_queue, "marks": dict(m.marks)}))
            self.child.forget(r)
            r.handle._finish(None)
        elif ids is not None:
            self.items.append((key, ids, False, None))

    def flush(self) -> None:
        items, self.items = self.items, []
        if items:
            self.child.send(("tokens", self.sid, items))


class _Session:
    """One attached scheduler's AR worker (and its thread, stage clock and process switches) over the child's
    runner."""

    def __init__(self, child: "_Child", sid: int, config):
        self.child, self.sid = child, sid
        self.switches: list = []
        runner, device = child.runner, child.device
        enable_for(runner, config)  # (another session may be mid-step)
        if device.type == "cuda" and config.ar_event_sync:  # the AR's read-back switch lives in this process
            from ..models.sampling import use_event_sync

            use_event_sync(+1)
            self.switches.append(use_event_sync)
        self.clock = StageClock(device.type == "cuda")
        self.worker = ARWorker(runner, config, _PipeSink(child, sid), lambda r, e: child.fail(sid, r, e), self.clock,
                               device)
        self.thread = threading.Thread(target=self._run, name=f"cosytrt-ar-{sid}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.loop()
        except Stopped:
            pass
        except BaseException as e:  # noqa: BLE001 - the parent fails every request it sent and reports why
            self.child.send(("died", self.sid, f"the AR worker in the AR process died: {e!r}"))

    def stop(self) -> list[RequestState]:
        """Stop the worker (its thread joined) and give back the process switches; returns the rows it held."""
        self.worker.stop()
        self.thread.join(timeout=30)
        while self.switches:
            self.switches.pop()(-1)
        return list(self.worker.running)

    def snapshot(self) -> dict:
        w = self.worker
        return {**w.snapshot(), "counters": dataclasses.asdict(w.counters), "busy_s": self.clock.busy_s(),
                "host_s": self.clock.host_s()}


class _Child:
    """The child's state: the runner, the sessions (attached schedulers), the live requests by the parent's key."""

    def __init__(self, conn, runner, lm, device):
        self.conn, self.runner, self.lm = conn, runner, lm
        self.device = torch.device(device)
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()
        self.live: dict[int, tuple[int, RequestState]] = {}  # key -> (session id, request)
        self.keys: dict[int, int] = {}  # id(RequestState) -> key
        self.sessions: dict[int, _Session] = {}

    # ---------------------------------------------------------------- messages
    def send(self, msg) -> None:
        with self.send_lock:
            send(self.conn, msg)

    def serve(self) -> None:
        handlers = {"attach": self._attach, "detach": self._detach, "submit": self._submit, "cancel": self._cancel,
                    "stats": self._stats, "save_cache": self._save_cache}
        while True:
            try:
                msg = recv(self.conn)
            except (EOFError, OSError):  # the parent is gone
                break
            if msg[0] == "close":
                break
            handlers[msg[0]](*msg[1:])
        for sid in list(self.sessions):
            self._stop_session(sid)
        self.runner.close()

    def _reply(self, call: int, fn) -> None:
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - the parent's call raises it
            self.send(("reply_error", call, portable_error(e)))
            return
        self.send(("reply", call, value))

    # ---------------------------------------------------------------- a scheduler's session
    def _attach(self, call: int, sid: int, config) -> None:
        def start():
            self.sessions[sid] = _Session(self, sid, config)
        self._reply(call, start)

    def _detach(self, call: int, sid: int) -> None:
        self._reply(call, lambda: self._stop_session(sid))

    def _stop_session(self, sid: int) -> None:
        """Stop session `sid`'s worker and drop what it held: requests left (its scheduler finishes them in the
        parent), their KV slots."""
        session = self.sessions.pop(sid, None)
        held = session.stop() if session is not None else []
        with self.lock:
            left = [r for key, (s, r) in self.live.items() if s == sid]
            for r in left:
                self.live.pop(self.keys.pop(id(r)), None)
        for r in left:
            r.handle._finish(RejectedError(f"request {r.req.request_id}: its scheduler closed"))
        for r in held + left:
            if r.slot is not None:
                self.runner.release(r.slot)
                r.slot = None

    # ---------------------------------------------------------------- requests
    def key_of(self, r: RequestState) -> int | None:
        return self.keys.get(id(r))

    def forget(self, r: RequestState) -> int | None:
        with self.lock:
            key = self.keys.pop(id(r), None)
            if key is not None:
                self.live.pop(key, None)
        return key

    def fail(self, sid: int, r: RequestState, e: BaseException) -> None:
        key = self.forget(r)
        r.handle._finish(e)
        if key is not None:
            self.send(("fail", sid, key, portable_error(e)))

    def _submit(self, sid: int, key: int, req, inputs, noise_room, t_submit: float, t_tokenizer: float) -> None:
        m = RequestMetrics(request_id=req.request_id, stream=req.stream, buffered_s=req.buffered_s)
        m.t_submit, m.t_tokenizer = t_submit, t_tokenizer  # perf_counter is the machine's monotonic clock
        r = RequestState(req, RequestHandle(req, m, lambda h: None), inputs)
        with self.lock:
            self.live[key] = (sid, r)
            self.keys[id(r)] = key
        session = self.sessions.get(sid)
        try:
            if session is None:
                raise RejectedError(f"request {req.request_id}: its scheduler is not attached to the AR process")
            ar_side(r, inputs, self.lm, self.runner, self.device, noise_room)
        except BaseException as e:  # noqa: BLE001 - this request fails alone
            self.fail(sid, r, e)
            return
        session.worker.put(r)

    def _cancel(self, key: int) -> None:
        with self.lock:
            sid, r = self.live.pop(key, (None, None))
            if r is not None:
                self.keys.pop(id(r), None)
        if r is not None:
            r.handle._finish(RejectedError(f"request {r.req.request_id} was cancelled"))
            session = self.sessions.get(sid)
            if session is not None:
                session.worker.wake()  # frees its KV slot at the next step

    def _stats(self, call: int, sid: int | None) -> None:
        def snapshot():
            session = self.sessions.get(sid)
            return session.snapshot() if session is not None else {"runner": runner_stats(self.runner)}
        self._reply(call, snapshot)

    def _save_cache(self, call: int, path: str) -> None:
        from ..stages.compiled import save_compile_cache

        self._reply(call, lambda: save_compile_cache(path))


def child_main(conn, lm_spec: dict, config, device: str, max_len: int, compile_cache: str | None) -> None:
    """The AR process's entry point (`multiprocessing` spawn target)."""
    import signal

    # The parent decides when this process ends (its close message, or the pipe's end if it dies): a Ctrl-C or a
    # service manager's SIGTERM to the whole process group must not end the AR under requests the parent still
    # drains (the parent then closes it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_grad_enabled(False)
    if torch.device(device).type == "cpu":  # the parent's threads and this one share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        if compile_cache and os.path.isfile(compile_cache):
            from ..stages.compiled import load_compile_cache

            load_compile_cache(compile_cache)
        lm = rebuild_lm(**lm_spec, device=device)
        runner = torch_ar_runner(lm, dataclasses.replace(config, ar_process=False), device, max_len)
        info = {"max_len": runner.max_len, "max_batch": runner.max_batch, "pid": os.getpid()}
    except BaseException as e:  # noqa: BLE001 - the parent's start raises it
        send(conn, ("failed", portable_error(e)))
        return
    send(conn, ("ready", info))
    _Child(conn, runner, lm, device).serve()
