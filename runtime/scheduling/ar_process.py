"""The AR in a process of its own (`SchedulerConfig.ar_process`): the parent's side (the child's: ar_process_child.py).

In one process the AR thread's per-step Python shares the interpreter lock with the DiT, vocoder, frontend and server
threads; under open-loop load its step took 6.45 ms for ~1.3 ms of kernels with the device busy only 42 % of the
time (BENCHMARKS.md run 68), which caps the AR at ~100 audio s/s. With `ar_process` the LM and its runner live in a
child process (one GPU shared by both processes; the LM weights copied over exactly, so the tokens are the same):

    Scheduler._prepare ─> RemoteARWorker.put ─> pipe ─> child: lm_input, policy ─> ARWorker (prefill / decode)
      ─> the new tokens at the stream's hop points / the end ─> pipe ─> ARProcess reader ─> dispatcher thread
      ─> RemoteARWorker.on_message ─> Token2WavWorker.tokens / flush (as the in-process AR thread hands them on)

`ARProcess` stands where an AR runner stands (`make_ar_runner` returns it; a TTS keeps it across `reconfigure`;
`max_len`, `max_batch`, `stats()`, `close()`); a Scheduler over it runs a `RemoteARWorker` where it would run an
`ARWorker`. The child is started with multiprocessing's spawn: a script that builds a TTS with `ar_process` at import
time must guard its entry point with `if __name__ == "__main__":` (as for any spawned worker).
"""
from __future__ import annotations

import atexit
import io
import itertools
import logging
import queue
import threading
import time
import weakref

import torch

from .ar_process_child import child_main, recv, send
from .ar_worker import Stopped
from .stats import ARCounters

START_TIMEOUT_S = 3600.0  # the child's start: the LM copy, its compile and graphs (cold compiles took minutes)
CALL_TIMEOUT_S = 120.0    # attach / detach / save_cache; stats wait STATS_TIMEOUT_S
STATS_TIMEOUT_S = 2.0
_OPEN: "weakref.WeakSet[ARProcess]" = weakref.WeakSet()
log = logging.getLogger("cosytrt.ar_process")


class ARProcessError(RuntimeError):
    """The AR process failed to start, died, or did not answer."""


class _Call:
    def __init__(self):
        self.event = threading.Event()
        self.value = None
        self.error: BaseException | None = None


def lm_spec(lm) -> dict:
    """What the child needs to rebuild `lm` exactly: its class, config, dtype, the attributes set on it that are not
    the runner's (`torch_ar_runner` sets batch_invariant and the decode attention there from the config), and its
    weights (serialized here: the parent's tensors are not touched)."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in lm.state_dict().items()}, buf)
    attrs = {k: getattr(lm, k) for k in ("reduce_attention_max_rows",) if hasattr(lm, k)}
    return {"lm_class": type(lm), "lm_config": lm.config, "state": buf.getvalue(), "dtype": lm.dtype,
            "attrs": attrs}


class ARProcess:
    """The child process holding the LM and its AR runner (see module docstring). `start_timeout_s`: how long the
    child may take to build its runner (ARProcessError after it, or as soon as the child fails: its own error).

    Several schedulers may run over it at once, as over an in-process runner (a TTS's scheduler draining during
    `reconfigure` while the next one starts; a benchmark's `make_scheduler`): each attaches a `RemoteARWorker` as a
    session of its own (its own AR worker in the child, the runner's steps taken in turn), and request keys are
    unique across sessions. Threads here: a sender (every message to the child), a reader (the child's messages:
    replies to calls at once, the rest queued) and a dispatcher (hands the sessions' tokens, failures and deaths to
    their workers: finishing a request runs callbacks that may wait for locks a caller holds while it waits for a
    reply, so replies never wait behind them)."""

    def __init__(self, lm, config, device, max_len: int, compile_cache: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=child_main, name="cosytrt-ar-process",
                                args=(child, lm_spec(lm), config, str(device), int(max_len), compile_cache))
        self.proc.start()
        child.close()
        self.dead: str | None = None
        self.workers: dict[int, RemoteARWorker] = {}  # session id -> the attached scheduler's worker
        self._sessions = itertools.count(1)
        self._keys = itertools.count()  # request keys, unique across sessions (a cancel names one request)
        # every message to the child goes through one sender thread, so no caller blocks on a full pipe: in
        # particular the reader thread never waits for a child that waits for the reader
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # the sessions' messages, for the dispatcher
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._closed = False
        try:
            self.info = self._wait_ready(start_timeout_s)
        except BaseException:
            self._kill()
            raise
        self.max_len, self.max_batch = int(self.info["max_len"]), int(self.info["max_batch"])
        self._threads = [threading.Thread(target=fn, name=f"cosytrt-ar-process-{name}", daemon=True)
                         for name, fn in (("reader", self._read), ("sender", self._send_loop),
                                          ("dispatcher", self._dispatch))]
        for t in self._threads:
            t.start()
        _OPEN.add(self)

    def new_key(self) -> int:
        return next(self._keys)

    # ---------------------------------------------------------------- start / stop
    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise ARProcessError(f"the AR process exited while starting (exit code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise ARProcessError(f"the AR process did not build its runner within {timeout_s:g} s")
        try:
            msg = recv(self.conn)
        except (EOFError, OSError) as e:
            raise ARProcessError(f"the AR process exited while starting (exit code {self.proc.exitcode})") from e
        if msg[0] == "failed":
            raise msg[1]
        return msg[1]

    def close(self) -> None:
        """Stop the child (its runner closed there) and wait for it; idempotent. A scheduler still attached (one made
        beside the TTS's own) fails its live requests (its AR is gone), as when the child dies."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(("close",))
        self._outbox.put(None)  # the sender's last message
        self.proc.join(timeout=30)
        self._kill()
        for w in list(self.workers.values()):
            w.on_died("the AR process was closed")
        _OPEN.discard(self)

    def _kill(self) -> None:
        """The child killed if it is still there (it ignores SIGTERM: see ar_process_child.child_main); its pipe and
        process handles closed."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)
        self.conn.close()
        try:
            self.proc.close()
        except ValueError:  # still running after the kill's wait: its handles go with the object
            pass

    # ---------------------------------------------------------------- messages
    def send(self, msg) -> None:
        """Queue `msg` for the child (ARProcessError if it is known dead or closed; a pipe that breaks later makes
        the process dead: its worker then fails every live request)."""
        if self.dead is not None:
            raise ARProcessError(self.dead)
        if self._closed:
            raise ARProcessError("the AR process is closed")
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                send(self.conn, msg)
            except (OSError, ValueError) as e:  # the pipe is gone with the child
                if not self._closed:
                    self._died(f"the AR process is gone ({e})")
                return

    def call(self, op: str, *args, timeout_s: float = CALL_TIMEOUT_S):
        """Ask the child and wait for its answer (its error raised here)."""
        c = _Call()
        with self._lock:
            cid = next(self._ids)
            self._calls[cid] = c
        try:
            self.send((op, cid, *args))
            if not c.event.wait(timeout_s):
                raise ARProcessError(f"the AR process did not answer {op!r} within {timeout_s:g} s")
        finally:
            with self._lock:
                self._calls.pop(cid, None)
        if c.error is not None:
            raise c.error
        return c.value

    def _read(self) -> None:
        """The reader thread: answers to calls at once; the sessions' messages queued for the dispatcher."""
        while True:
            try:
                msg = recv(self.conn)
            except (EOFError, OSError):
                if not self._closed:
                    self.proc.join(timeout=2)  # reaped: its exit code (a signal: -N)
                    self._died(f"the AR process exited (exit code {self.proc.exitcode})")
                self._inbox.put(None)  # the dispatcher's end (after what is queued)
                return
            op = msg[0]
            if op in ("reply", "reply_error"):
                with self._lock:
                    c = self._calls.get(msg[1])
                if c is not None:
                    c.value, c.error = (msg[2], None) if op == "reply" else (None, msg[2])
                    c.event.set()
            else:
                self._inbox.put(msg)

    def _dispatch(self) -> None:
        """The dispatcher thread: each session's messages to its worker, in order; the process's death to every
        worker after what came before it. A handler's error is logged, and the next message handled."""
        while True:
            msg = self._inbox.get()
            if msg is None:
                return
            try:
                if msg[0] == "process_died":
                    for w in list(self.workers.values()):
                        w.on_died(msg[1])
                    continue
                w = self.workers.get(msg[1])
                if w is None:  # its scheduler detached (it finishes its own requests)
                    continue
                if msg[0] == "died":  # that session's AR worker died in the child
                    w.on_died(msg[2])
                else:
                    w.on_message(msg)
            except Exception:  # noqa: BLE001 - e.g. a finish callback that raised: the others go on
                log.exception("handling the AR process's %r message failed", msg[0])

    def _died(self, reason: str) -> None:
        self.dead = reason
        with self._lock:
            calls = list(self._calls.values())
        for c in calls:
            c.error = ARProcessError(reason)
            c.event.set()
        self._inbox.put(("process_died", reason))

    # ---------------------------------------------------------------- what a Scheduler asks of a runner
    def attach(self, worker, config) -> int:
        """`worker` (a RemoteARWorker) gets its session's messages from now on; the child starts an AR worker with
        `config` over its runner for that session. Returns the session id."""
        sid = next(self._sessions)
        self.workers[sid] = worker
        try:
            self.call("attach", sid, config)
        except BaseException:
            self.workers.pop(sid, None)
            raise
        return sid

    def detach(self, sid: int) -> None:
        if sid in self.workers:
            try:
                if self.dead is None:
                    self.call("detach", sid)
            finally:
                self.workers.pop(sid, None)

    def stats(self, sid: int | None = None) -> dict:
        """The snapshot of session `sid`'s worker in the child (`ARWorker.snapshot`, counters as a dict, busy / host
        seconds) or, when the child does not answer in time, the runner's size alone: stats must not fail a
        caller."""
        try:
            return self.call("stats", sid, timeout_s=STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            return {"runner": {"slots": self.max_batch, "max_len": self.max_len}}

    def save_compile_cache(self, path: str) -> int:
        """The child's torch.compile artifacts (the LM's) written to `path`; bytes written."""
        return int(self.call("save_cache", path))


def _close_all() -> None:  # before multiprocessing's own exit handler joins the children
    for p in list(_OPEN):
        p.close()


atexit.register(_close_all)


class RemoteARWorker:
    """Stands where the ARWorker stands in a Scheduler when the AR runs in its own process (see module docstring):
    `put` sends a prepared request there; the tokens that come back go to the sink as the ARWorker hands them on;
    `loop` watches the process, and its death fails every live request (as a dead worker thread does)."""

    def __init__(self, proc: ARProcess, config, sink, fail):
        self.proc, self.sink, self.fail = proc, sink, fail
        self.runner = proc
        self.cond = threading.Condition()
        self.live: dict[int, object] = {}   # key -> RequestState, until its last tokens or its failure came back
        self.stopped = False
        self.died: str | None = None
        self.counters = ARCounters()        # the child's, as of the last snapshot
        self.sid = proc.attach(self, config)

    # ---------------------------------------------------------------- the scheduler's side
    def put(self, r) -> None:
        """Send a prepared request to the child. One that died meanwhile (cancelled while its frontend work ran) is
        not sent, as the in-process worker drops it before admission; the check and the send are one step under
        `cond`, so a `wake` for it comes after its submit (the child then drops it)."""
        key = self.proc.new_key()
        m = r.metrics
        msg = ("submit", self.sid, key, r.req.without_voice(), r.inputs.lm_only(), r.noise_room, m.t_submit,
               m.t_tokenizer)
        with self.cond:
            if r.dead:
                return
            self.live[key] = r
            try:
                self.proc.send(msg)  # a queue put: never blocks
                return
            except Exception as e:  # noqa: BLE001 - this request fails (the process is gone: loop fails the rest)
                self.live.pop(key, None)
                err = e
        self.fail(r, err)

    def wake(self) -> None:
        """A request died (cancelled, failed elsewhere): the child drops it and frees its KV slot."""
        with self.cond:
            gone = [k for k, r in self.live.items() if r.dead]
            for k in gone:
                del self.live[k]
            self.cond.notify_all()
        for k in gone:
            try:
                self.proc.send(("cancel", k))
            except Exception:  # noqa: BLE001 - the process is gone: nothing holds the slot
                pass

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        try:
            self.proc.detach(self.sid)
        except Exception:  # noqa: BLE001 - a dead or stuck child: closing goes on
            pass

    def active(self) -> bool:
        return bool(self.live)

    def loop(self) -> None:
        with self.cond:
            while not self.stopped and self.died is None:
                self.cond.wait()
        if self.died is not None and not self.stopped:
            raise ARProcessError(self.died)
        raise Stopped

    def snapshot(self) -> dict:
        """`ARWorker.snapshot` of the child's worker (its last counters when the child does not answer)."""
        s = self.proc.stats(self.sid)
        if "counters" in s:
            self.counters = ARCounters(**s["counters"])
        return {"waiting": s.get("waiting", 0), "running": s.get("running", 0),
                "runner": {**s["runner"], "process_pid": self.proc.info["pid"]}, "counters": self.counters,
                "busy_s": s.get("busy_s", {}), "host_s": s.get("host_s", {})}

    # ---------------------------------------------------------------- the process's reader thread
    def on_message(self, msg) -> None:
        """A message of this worker's session (the dispatcher thread): ("tokens", sid, items) or ("fail", sid, key,
        error)."""
        if msg[0] == "tokens":
            for key, ids, done, meta in msg[2]:
                with self.cond:
                    r = self.live.pop(key, None) if done else self.live.get(key)
                if r is None or r.dead:
                    continue
                try:
                    if ids is not None:
                        r.tokens.extend(ids.tolist())
                    if meta is not None:
                        m = r.metrics
                        m.t_ar, m.t_queue = meta["t_ar"], meta["t_queue"]
                        for k, v in meta["marks"].items():
                            m.marks.setdefault(k, v)
                    self.sink.tokens(r, done)
                except Exception as e:  # noqa: BLE001 - this request fails alone
                    self.fail(r, e)
            self.sink.flush()
        elif msg[0] == "fail":
            with self.cond:
                r = self.live.pop(msg[2], None)
            if r is not None:
                self.fail(r, msg[3])

    def on_died(self, reason: str) -> None:
        with self.cond:
            self.died = reason
            self.cond.notify_all()
