"""A speech request on the shared TTS, as the server runs it: the input normalised and split into sentences, one
runtime request per segment (submitted in order, so they batch as capacity allows), consumed in order as one
response."""
import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import AsyncIterator

import numpy as np

from .segments import normalize, segment_budget, split_sentences
from .settings import ServerSettings

log = logging.getLogger("cosytrt.server")
_NEEDS_NORMALIZING = set("0123456789$%&@#€£¥+=/°§")


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


SEGMENTS_AHEAD = 2  # a job's segments in the runtime beyond the one its response is at


class SpeechJob:
    """One HTTP speech request on the shared TTS: one runtime request per text segment, submitted in order (so they
    batch as capacity allows), consumed in order from the event loop. At most `ahead` segments are submitted beyond
    the one being consumed: the segments run under the request's one admission ticket, so without a bound one long
    input (hundreds of sentences) put them all in the runtime at once, ahead of every other client's request."""

    def __init__(self, tts, texts: list[str], options: dict, stream: bool, ahead: int = SEGMENTS_AHEAD):
        self.tts, self.texts, self.options, self.stream = tts, texts, options, stream
        self.ahead = max(0, int(ahead))
        self.handles: list = []
        self.cancelled = False
        self._submitted = asyncio.Event()  # set after each submit (and at the end)
        self._consumed = asyncio.Event()   # set when the response moves to its next segment (and on cancel)
        self._consuming = 0                # the segment the response is at
        self._submit_error: BaseException | None = None
        self._done_submitting = False

    @property
    def handle(self):
        return self.handles[0] if self.handles else None

    @property
    def metrics(self):
        ms = [getattr(h, "metrics", None) for h in self.handles]
        ms = [m for m in ms if m is not None]
        if len(ms) <= 1:
            return ms[0] if ms else None
        total = lambda a: sum(float(getattr(m, a, 0.0) or 0.0) for m in ms)  # noqa: E731
        audio = total("audio_seconds")
        syn = total("total")
        return SimpleNamespace(t_tokenizer=total("t_tokenizer"), t_ar=total("t_ar"), t_dit=total("t_dit"),
                               t_vocoder=total("t_vocoder"), t_queue=getattr(ms[0], "t_queue", 0.0),
                               ttfa=getattr(ms[0], "ttfa", None), tokens=int(total("tokens")),
                               audio_seconds=audio, total=syn, rtf=(syn / audio) if audio > 0 else None)

    async def start(self, executor: ThreadPoolExecutor) -> None:
        """Submit the first segment (errors propagate: RejectedError, InputError), then the rest in the
        background."""
        loop = asyncio.get_running_loop()

        def submit(text):
            return self.tts.submit(text, stream=self.stream, **self.options)

        fut = loop.run_in_executor(executor, submit, self.texts[0])
        try:
            h = await asyncio.shield(fut)
        except asyncio.CancelledError:  # the caller went away while submitting: cancel the request once it exists
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().cancel())
            raise
        self.handles.append(h)
        if self.cancelled:
            h.cancel()
        if len(self.texts) == 1:
            self._done_submitting = True
            return

        async def run_rest():
            try:
                for i, text in enumerate(self.texts[1:], 1):
                    while i - self._consuming > self.ahead and not self.cancelled:
                        self._consumed.clear()
                        await self._consumed.wait()
                    if self.cancelled:
                        return
                    h = await loop.run_in_executor(executor, submit, text)  # may wait for space in the runtime
                    self.handles.append(h)
                    if self.cancelled:
                        h.cancel()
                    self._submitted.set()
            except BaseException as e:  # noqa: BLE001 - surfaced by chunks()
                self._submit_error = e
            finally:
                self._done_submitting = True
                self._submitted.set()

        self._rest = asyncio.ensure_future(run_rest())

    async def chunks(self) -> AsyncIterator[np.ndarray]:
        i = 0
        while True:
            if i < len(self.handles):
                async for c in self.handles[i].achunks():
                    yield c
                i += 1
                self._consuming = i
                self._consumed.set()
                continue
            if self._done_submitting:
                if self._submit_error is not None:
                    raise self._submit_error
                return
            self._submitted.clear()
            if i < len(self.handles) or self._done_submitting:
                continue
            await self._submitted.wait()

    def cancel(self) -> None:
        self.cancelled = True
        self._consumed.set()  # a submitter waiting for the response to move on stops
        for h in list(self.handles):
            try:
                h.cancel()
            except Exception:  # noqa: BLE001
                log.exception("cancelling a request failed")


@contextlib.asynccontextmanager
async def tracked_job(state, job: SpeechJob, ticket):
    """Run `job` registered with the server for the `async with` body: started on enter; on exit cancelled unless
    the body completed, unregistered, and its outcome (ok / error / cancelled) recorded. The admission ticket stays
    with the caller's `state.admitted` block (batch items and websocket sentences)."""
    state.jobs.add(job)
    outcome = "cancelled"
    try:
        await job.start(state.executor)
        yield job
        outcome = "ok"
    except Exception:
        outcome = "error"
        raise
    finally:
        if outcome != "ok":
            job.cancel()
        state.jobs.discard(job)
        state.metrics.finish(outcome, job.metrics, ticket.waited)


async def segments(state, text: str, options: dict, speaker=None) -> list[str]:
    """`segment_text` off the event loop (the normaliser takes seconds on a long input full of numbers)."""
    return await asyncio.get_running_loop().run_in_executor(state.decoder, segment_text, text, state.settings,
                                                            options, state.tts, speaker)


def segment_text(text: str, settings: ServerSettings, options: dict, tts=None, speaker=None) -> list[str]:
    """The texts to synthesise for one `input`: normalised (only when it has digits / symbols) and split into
    sentences that fit the model; one piece when `force_tokens` fixes the length of the whole request."""
    if settings.normalize_text and _NEEDS_NORMALIZING.intersection(text):
        text = normalize(text)
    if "force_tokens" in options:
        return [text]
    budget, count = segment_budget(tts, speaker, settings.max_segment_units)
    return split_sentences(text, budget, count=count) or [text]
