"""O(chunk) streaming HiFT with the exact output of upstream's quadratic streaming loop.

Upstream (`CosyVoice2Model.tts` + `CosyVoice3Model.token2wav`) keeps every mel frame so far and, for every chunk,
re-runs HiFT on the whole prefix (`finalize=False`, the final chunk `finalize=True`) and returns the samples past those
already sent. HiFT is causal with a finite receptive field, except for the sine phase, which integrates f0 from frame 0.
So a chunk only needs:

  * the exact f0 of each frame once: f0 of frame j needs mel [j - 8, j + 3]; new frames are predicted from a window of
    8 frames of mel history plus the new mel (`f0_left_context` / `f0_look_right`);
  * the cumulative phase: a float64 running sum carried across chunks (the same sequential sum upstream computes);
  * the fixed noise at the absolute sample offset;
  * `decode_left_context()` (~30) frames of mel / f0 / phase history before the first new output frame, so that the
    left-padded convs, STFT and iSTFT of the window reproduce the full-prefix values from that frame on.

`push(mel_chunk, finalize)` therefore runs f0 on (8 + chunk + 3) frames and the conv stack on (context + chunk + 8)
frames whatever the history length, and its outputs concatenate to exactly what the upstream loop yields.
State is kept in plain attributes so that `push_batch` can advance several streams together (windows of equal length
are stacked into one batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engines.errors import InputError
from .hift import HiFT


@dataclass
class _Job:
    stream: "HiFTStream"
    finalize: bool
    lo: int            # absolute first frame of the window
    hi: int            # absolute end frame of the window (exclusive)
    skip: int = 0      # outputs of the window to drop (frames for f0, samples for wav)
    result: torch.Tensor | None = None


WINDOW_STEP = 16  # decode windows are rounded up to a multiple of this many frames when history allows


class HiFTStream:
    """One request's streaming state. `push` returns the new samples [1, m] of that chunk."""

    def __init__(self, hift: HiFT, context_frames: int | None = None, decoder=None):
        """`decoder(mel, source, finalize)`: what runs the decode windows (e.g. bucketed CUDA graphs of them, see
        `StageBackends.hift_stream_windows`); None: `hift.decode`."""
        self.hift = hift
        self.decoder = decoder
        # history kept for the conv stack: its receptive field plus WINDOW_STEP - 1 spare frames, so decode windows
        # can be rounded up to a multiple of WINDOW_STEP with real history (exact, and few distinct shapes: cuDNN
        # plans and CUDA graphs are per shape)
        self.min_context = hift.decode_left_context() if context_frames is None else int(context_frames)
        self.context_frames = self.min_context + WINDOW_STEP - 1
        h = hift.harmonics
        dev = hift.sine_waves.device
        self.mel = torch.zeros(1, hift.cfg.in_channels, 0, device=dev)  # frames [mel_start, frames)
        self.mel_start = 0
        self.frames = 0                  # mel frames received
        self.f0 = torch.zeros(1, 0, device=dev)                       # exact f0 of frames [f0_start, f0_end)
        self.cum_phase = torch.zeros(1, 0, h, dtype=torch.float64, device=dev)  # running phase sum, same frames
        self.f0_start = 0
        self.f0_end = 0
        self.emitted = 0                 # samples returned so far
        self.finished = False
        # work done by the last push (for tests / metrics): frames passed to the f0 predictor and the conv stack
        self.last_f0_window_frames = 0
        self.last_decode_window_frames = 0

    # ------------------------------------------------------------------ public

    def push(self, mel_chunk: torch.Tensor, finalize: bool = False) -> torch.Tensor:
        """Add mel frames [1, 80, n] (n may be 0); returns the new samples [1, m]."""
        return push_batch([self], [mel_chunk], [finalize])[0]

    @property
    def history_frames(self) -> int:
        """Mel frames currently held (bounded by the receptive field, not the request length)."""
        return self.mel.shape[2]

    # ------------------------------------------------------------------ internals

    def _mel(self, lo: int, hi: int) -> torch.Tensor:
        return self.mel[:, :, lo - self.mel_start:hi - self.mel_start]

    def _f0(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = lo - self.f0_start, hi - self.f0_start
        return self.f0[:, a:b], self.cum_phase[:, a:b]

    def _trim(self) -> None:
        """Drop history no later push can need."""
        next_out = self.emitted // self.hift.samples_per_frame
        decode_lo = max(0, next_out - self.context_frames)
        mel_lo = max(0, min(decode_lo, self.f0_end - self.hift.f0_left_context))
        f0_lo = max(0, min(decode_lo, self.f0_end - 1))
        if mel_lo > self.mel_start:
            self.mel = self.mel[:, :, mel_lo - self.mel_start:]
            self.mel_start = mel_lo
        if f0_lo > self.f0_start:
            self.f0 = self.f0[:, f0_lo - self.f0_start:]
            self.cum_phase = self.cum_phase[:, f0_lo - self.f0_start:]
            self.f0_start = f0_lo


def _run_grouped(jobs: list[_Job], run) -> None:
    """Run `run(jobs_of_equal_shape) -> list[tensor]` once per (window length, finalize) group."""
    groups: dict[tuple[int, bool], list[_Job]] = {}
    for j in jobs:
        groups.setdefault((j.hi - j.lo, j.finalize), []).append(j)
    for group in groups.values():
        for j, r in zip(group, run(group)):
            j.result = r


@torch.no_grad()
def push_batch(streams: list[HiFTStream], chunks: list[torch.Tensor], finalize_flags: list[bool]) -> list[torch.Tensor]:
    """Advance several streams (sharing one HiFT) by one chunk each; returns each stream's new samples [1, m]."""
    if not (len(streams) == len(chunks) == len(finalize_flags)):
        raise InputError(f"push_batch: {len(streams)} streams, {len(chunks)} chunks, {len(finalize_flags)} flags")
    if len({id(s) for s in streams}) != len(streams):
        raise InputError("push_batch: a stream appears twice in one batch")
    if not streams:
        return []
    hift = streams[0].hift
    spf = hift.samples_per_frame
    look_f0, held = hift.f0_look_right, hift.held_back_frames

    # validate everything before touching any state
    mels = []
    for i, (s, c, fin) in enumerate(zip(streams, chunks, finalize_flags)):
        if s.hift is not hift:
            raise InputError(f"push_batch: stream {i} uses a different HiFT")
        if s.finished:
            raise InputError(f"push_batch: stream {i} was already finalized")
        if c.ndim == 2:
            c = c.unsqueeze(0)
        if c.ndim != 3 or c.shape[0] != 1 or c.shape[1] != hift.cfg.in_channels:
            raise InputError(f"push_batch: chunk {i} must have shape (1, {hift.cfg.in_channels}, n), "
                             f"got {tuple(c.shape)}")
        total = s.frames + c.shape[2]
        hift.check_noise(total if fin else max(0, total - look_f0))
        mels.append(c.to(device=s.mel.device, dtype=s.mel.dtype))

    for s, c in zip(streams, mels):
        s.mel = torch.cat([s.mel, c], dim=2)
        s.frames += c.shape[2]

    # 1) exact f0 for the frames that became computable
    f0_jobs = []
    for s, fin in zip(streams, finalize_flags):
        target = s.frames if fin else max(s.frames - look_f0, s.f0_end)
        s.last_f0_window_frames = 0
        if target > s.f0_end:
            lo = max(0, s.f0_end - hift.f0_left_context)
            f0_jobs.append(_Job(s, fin, lo, s.frames, skip=s.f0_end - lo))
            s.last_f0_window_frames = s.frames - lo

    def run_f0(group):
        f0 = hift.predict_f0(torch.cat([j.stream._mel(j.lo, j.hi) for j in group]), group[0].finalize)
        return [f0[r:r + 1, j.skip:] for r, j in enumerate(group)]
    _run_grouped(f0_jobs, run_f0)

    for j in f0_jobs:
        s = j.stream
        start = s.cum_phase[:, -1] if s.cum_phase.shape[1] else None
        s.cum_phase = torch.cat([s.cum_phase, hift.cumulative_phase(j.result, start)], dim=1)
        s.f0 = torch.cat([s.f0, j.result], dim=1)
        s.f0_end += j.result.shape[1]

    # 2) the new samples: decode a window of context + new frames
    dec_jobs = []
    for s, fin in zip(streams, finalize_flags):
        s.last_decode_window_frames = 0
        out_end = s.frames if fin else s.frames - held
        first = s.emitted // spf
        if out_end * spf <= s.emitted or s.frames == 0:
            continue
        hi = s.frames if fin else s.frames - look_f0
        lo = max(0, first - s.min_context)
        rounded = hi - -(-(hi - lo) // WINDOW_STEP) * WINDOW_STEP
        if rounded >= max(s.mel_start, s.f0_start):
            lo = rounded
        dec_jobs.append(_Job(s, fin, lo, hi, skip=s.emitted - lo * spf))
        s.last_decode_window_frames = hi - lo

    def run_decode(group):
        mel = torch.cat([j.stream._mel(j.lo, j.hi) for j in group])
        f0, cum = zip(*(j.stream._f0(j.lo, j.hi) for j in group))
        noise = torch.cat([hift.noise_slice(j.lo, j.hi - j.lo) for j in group])
        source = hift.source_from_phase(torch.cat(f0), torch.cat(cum), noise)
        wav = (group[0].stream.decoder or hift.decode)(mel, source, group[0].finalize)
        return [wav[r:r + 1, j.skip:] for r, j in enumerate(group)]
    _run_grouped(dec_jobs, run_decode)

    out = []
    for s, fin in zip(streams, finalize_flags):
        job = next((j for j in dec_jobs if j.stream is s), None)
        new = job.result if job is not None else s.mel.new_zeros(1, 0)
        s.emitted += new.shape[1]
        s.finished = bool(fin)
        s._trim()
        out.append(new)
    return out


@torch.no_grad()
def warm_decode_windows(hift: HiFT, max_frames: int = 416, batches=(1, 2, 4, 8)) -> int:
    """Run the conv stack once at every rounded window length (and batch) a stream can produce, so that cuDNN's
    per-shape planning (tens of ms per new shape on an H200) happens at load, not on a request's first chunk.
    Returns the number of shapes warmed."""
    dev = hift.sine_waves.device
    spf = hift.samples_per_frame
    n = 0
    for frames in range(WINDOW_STEP, max_frames + 1, WINDOW_STEP):
        for b in batches:
            for fin in (False, True):
                mel = torch.full((b, hift.cfg.in_channels, frames), -4.0, device=dev)
                src = torch.zeros(b, 1, frames * spf, device=dev)
                hift.decode(mel, src, finalize=fin)
                n += 1
    return n
