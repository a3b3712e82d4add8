"""Speech-token sampling as upstream CosyVoice3 does it: RAS (repetition-aware nucleus sampling), min/max length,
stop tokens and the silent-token run limit.

Upstream references (FunAudioLLM/CosyVoice):
- `cosyvoice/utils/common.py`: `ras_sampling`, `nucleus_sampling`, `random_sampling`.
- `cosyvoice/llm/llm.py` (`Qwen2LM.inference_wrapper`, `sampling_ids`): min_len = 2 * text_len, max_len = 20 * text_len
  (target text tokens only), stop on any id in 6561..6760.
- `cosyvoice/cli/model.py` (`llm_job`): after 5 silent tokens in a row, further ones are dropped from the output
  (they are still fed back to the LM and still count in the RAS window and towards max_len).

Upstream quirk, reproduced on purpose: before min_len, `sampling_ids(ignore_eos=True)` masks only index
`speech_token_size` (6561: CosyVoice2's eos, CosyVoice3's sos); CosyVoice3's eos 6562 and the other stop ids stay
sampleable, so a request can stop before min_len. `TokenPolicy(..., mask_all_stops_before_min=True)` masks every
stop id instead.

Batched: `sample_batch(logits [B, V], policies)` samples every running row in one set of tensor ops with ONE host
sync (`ras_select` does the RAS on tensors; per-row top_p / top_k / greedy / window are [B] tensors), then each
`TokenPolicy.accept` does the light per-row bookkeeping. `TokenPolicy.step` is `sample_batch` for one row, so the
single-request loop (`generate`) and the scheduler give the same tokens. Draws are inverse-CDF with two uniforms per
row per step (nucleus draw, repeat resample) from the request's own CPU `torch.Generator` (seeded by
`SamplingParams.seed`): a request's random stream does not depend on the rows batched with it. The draws differ from
upstream's `torch.multinomial` stream; the distribution and the RAS semantics are upstream's.

Host cost per step (issue #18): the nucleus's sorted head comes from one topk over unique keys (`sorted_head`,
exactly the stable sort's first top_k), not a sort of the whole vocab; a policy draws its uniforms DRAW_BLOCK steps
at a time; the host values go up as one flat float32 tensor. tests/test_sampling_exact.py keeps the previous form
as the reference: same ids for every seed / parameter mix / batch composition tried, ties included.
"""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from .config import NUM_SPECIAL, SILENT_TOKENS, SPEECH_TOKEN_SIZE
from ...engines.errors import InputError

MAX_SILENT_RUN = 5
_SILENT = frozenset(SILENT_TOKENS)


# ---------------------------------------------------------------- reading the sampled ids back

_EVENT_SYNC = {"on": False, "users": 0}
_EVENT_SYNC_LOCK = threading.Lock()
_HOST = threading.local()  # per thread: pinned buffers by dtype, one CUDA event


def set_event_sync(on: bool) -> bool:
    """Process-wide: read sampled ids back through `ids_to_host`'s event wait (True) or `.tolist()` — an explicit
    switch beside the schedulers that use it (`use_event_sync`); returns the previous switch."""
    with _EVENT_SYNC_LOCK:
        prev, _EVENT_SYNC["on"] = _EVENT_SYNC["on"], bool(on)
    return prev


def use_event_sync(delta: int) -> None:
    """A scheduler with `SchedulerConfig.ar_event_sync` on CUDA registers (+1) when it starts and unregisters (-1)
    when it closes: the event read-back is on while any is registered (or `set_event_sync(True)`), so schedulers
    that overlap (a benchmark's) and close in any order leave each other's setting alone."""
    with _EVENT_SYNC_LOCK:
        _EVENT_SYNC["users"] = max(0, _EVENT_SYNC["users"] + delta)


def event_sync_on() -> bool:
    return _EVENT_SYNC["on"] or _EVENT_SYNC["users"] > 0


def ids_to_host(ids: torch.Tensor) -> list:
    """`ids.tolist()` — the AR's one host sync per step. With the event read-back on (`event_sync_on`) on CUDA: a
    non-blocking copy into a pinned buffer of this thread, an event recorded after it on the current stream and
    waited for, then the list from host memory, instead of the synchronous copy into pageable memory that `.tolist()`
    makes (the AR thread spends most of every step in that wait, and the DiT and HiFT threads were held back with it:
    BENCHMARKS.md runs 42-43 and 48). The same values either way."""
    if ids.device.type != "cuda" or not event_sync_on():
        return ids.tolist()
    flat = ids.reshape(-1)
    n = flat.numel()
    bufs = getattr(_HOST, "bufs", None)
    if bufs is None:
        bufs = _HOST.bufs = {}
        _HOST.event = torch.cuda.Event()
    buf = bufs.get(flat.dtype)
    if buf is None or buf.numel() < n:
        buf = bufs[flat.dtype] = torch.empty(max(64, 1 << max(0, n - 1).bit_length()), dtype=flat.dtype,
                                            pin_memory=True)
    buf[:n].copy_(flat, non_blocking=True)
    _HOST.event.record()
    _HOST.event.synchronize()
    return buf[:n].view(ids.shape).tolist()


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    seed: int | None = None
    greedy: bool = False
    max_tokens: int | None = None
    min_tokens: int | None = None
    # Benchmarks: never stop before exactly N tokens, then stop (stop ids masked, no silent-token dropping).
    force_tokens: int | None = None

    def __post_init__(self):
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InputError(f"SamplingParams.top_p must be a number in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1:
            raise InputError(f"SamplingParams.top_k must be a positive int, got {self.top_k!r}")
        if not isinstance(self.win_size, int) or isinstance(self.win_size, bool) or self.win_size < 1:
            raise InputError(f"SamplingParams.win_size must be a positive int, got {self.win_size!r}")
        if not _is_real(self.tau_r) or not (0.0 < self.tau_r < math.inf):
            raise InputError(f"SamplingParams.tau_r must be a finite number > 0, got {self.tau_r!r}")
        if not isinstance(self.greedy, bool):
            raise InputError(f"SamplingParams.greedy must be True or False, got {self.greedy!r}")
        if self.seed is not None:  # torch.manual_seed takes [0, 2**64) (a negative seed would alias a large one)
            if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) \
                    or not 0 <= self.seed < 2 ** 64:
                raise InputError(f"SamplingParams.seed must be an int in [0, 2**64) or None (a random seed), got "
                                 f"{self.seed!r}")
            self.seed = int(self.seed)  # a numpy integer too
        for name in ("max_tokens", "min_tokens", "force_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if name != "min_tokens" else 0)):
                raise InputError(f"SamplingParams.{name} must be a {'non-negative' if name == 'min_tokens' else 'positive'}"
                                 f" int or None, got {v!r}")
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InputError(f"SamplingParams.min_tokens {self.min_tokens} > max_tokens {self.max_tokens}")

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


# ---------------------------------------------------------------- batched RAS on tensors (no host sync)

_CONSTANTS: dict = {}


def _constant(name: str, n: int, device: torch.device) -> torch.Tensor:
    """Read-only tensors made once per (name, n, device): 'arange' = arange(n), 'zero' = a float32 0-dim zero. On
    CUDA the first use waits for it once, so that other streams may read it later."""
    t = _CONSTANTS.get((name, n, device))
    if t is None:
        t = torch.arange(n, device=device) if name == "arange" else torch.zeros((), device=device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        _CONSTANTS[(name, n, device)] = t
    return t


def _arange(n: int, device: torch.device) -> torch.Tensor:
    return _constant("arange", n, device)


def sorted_head(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `k` columns of `probs.sort(dim=-1, descending=True, stable=True)` ([B, N] float32 >= 0): (values,
    indices), each [B, k]. One smallest-k over unique int64 keys `column - bits(prob) * 2**s` (2**s > N) instead of
    a sort of all N: a non-negative float32's bits order as its value does, so the keys order by prob descending,
    then by column ascending, exactly as the stable sort puts equal probs (ties included); the key's low s bits are
    the column (two's complement)."""
    n = probs.shape[-1]
    shift = max(1, (n - 1).bit_length())
    key = torch.add(_arange(n, probs.device), probs.contiguous().view(torch.int32), alpha=-(1 << shift))
    idx = key.topk(k, dim=-1, largest=False).values.bitwise_and_((1 << shift) - 1)
    return probs.gather(1, idx), idx


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` [B, N] (>= 0, unnormalised) the index i with cdf[i-1] <= u * total < cdf[i], for
    uniforms `u` [B] in [0, 1): a draw proportional to the weights. Zero-weight entries are never picked (unless a
    row is all zeros). Returns [B, 1]."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, _constant("zero", 0, total.device)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)


def nucleus_keep(sorted_probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Which of the descending probs [B, N] upstream keeps: position i while the cumulative probability BEFORE it is
    < top_p and i < top_k (`top_p`, `top_k` [B]). Bool [B, N]; position 0 is always kept."""
    before = torch.nn.functional.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
    pos = _arange(sorted_probs.shape[-1], sorted_probs.device)
    return (before < top_p[:, None]) & (pos[None] < top_k[:, None])


def ras_select(scores: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, greedy: torch.Tensor | None,
               uniforms: torch.Tensor, window: torch.Tensor, repeat_min: torch.Tensor,
               max_top_k: int | None = None, repeated_only: bool | None = None) -> torch.Tensor:
    """RAS for B rows at once, all tensors on one device, no host sync on CUDA. Returns the ids [B] (long).

    scores [B, V] float32 (logits or log-probs, -inf = masked); top_p [B] float; top_k [B] (long, or float32 holding
    ints: compared exactly); greedy [B] bool, or None when no row is greedy (no argmax); uniforms [B, 2] in [0, 1)
    (column 0: nucleus draw, column 1: repeat resample); window [B, W] (long, or float32 holding ids < 2**24): the
    row's last win_size sampled ids, padded with -1; repeat_min [B]: the drawn id is resampled when it occurs
    >= repeat_min times in the window; max_top_k: a bound on top_k (python int) so only that many sorted probs are
    found. Greedy rows take the argmax. Otherwise inverse-CDF nucleus sampling; a repeated id is masked and an id is
    drawn from the full softmax of what is left (upstream `ras_sampling`). `repeated_only` (default: on the CPU)
    computes that softmax for the repeated rows only (row-wise ops: the same values as for every row; it costs a
    host sync, which is nothing on the CPU)."""
    probs = scores.softmax(dim=-1)
    n = probs.shape[-1]
    head, head_idx = sorted_head(probs, n if max_top_k is None else min(max_top_k, n))
    head = head * nucleus_keep(head, top_p, top_k)
    nucleus_id = head_idx.gather(1, _inverse_cdf(head, uniforms[:, 0]))                          # [B, 1]
    repeated = (window == nucleus_id).sum(dim=-1, keepdim=True) >= repeat_min[:, None]
    if repeated_only if repeated_only is not None else scores.device.type == "cpu":
        ids = nucleus_id
        rows = repeated[:, 0].nonzero()[:, 0]
        if rows.numel():
            ids = nucleus_id.clone()
            rest = scores[rows].scatter(1, nucleus_id[rows], float("-inf")).softmax(dim=-1)
            ids[rows] = _inverse_cdf(rest, uniforms[rows, 1])
    else:
        rest = scores.scatter(1, nucleus_id, float("-inf")).softmax(dim=-1)
        ids = torch.where(repeated, _inverse_cdf(rest, uniforms[:, 1]), nucleus_id)
    if greedy is not None:
        ids = torch.where(greedy[:, None], scores.argmax(dim=-1, keepdim=True), ids)
    return ids[:, 0]


def _repeat_min(params: SamplingParams) -> int:
    """Smallest repeat count that triggers the resample: count >= win_size * tau_r (exact for integer counts)."""
    return math.ceil(params.win_size * params.tau_r)


DRAW_BLOCK = 32   # sampling steps of uniforms a policy draws from its generator at once


# Host-side inputs of one row, uploaded as one float32 tensor [B, _WINDOW + W] (ids < 2**24 are exact in float32).
_U_NUCLEUS, _U_RESAMPLE, _TOP_P, _TOP_K, _REPEAT_MIN, _GREEDY, _STOP_MODE, _WINDOW = range(8)


def _upload(flat: list[float], rows: int, device: torch.device) -> torch.Tensor:
    """The row-major host values -> one float32 [rows, C] tensor on `device`, without a host sync (pinned and
    non-blocking on CUDA; the pinned block goes back to torch's caching host allocator once the copy is done)."""
    if device.type == "cuda":
        return torch.tensor(flat, dtype=torch.float32, pin_memory=True).view(rows, -1).to(device, non_blocking=True)
    return torch.tensor(flat, dtype=torch.float32, device=device).view(rows, -1)


def _select(scores: torch.Tensor, rows: torch.Tensor, max_top_k: int, any_greedy: bool = True) -> torch.Tensor:
    """`ras_select` with its inputs read from the uploaded row tensor."""
    return ras_select(scores, rows[:, _TOP_P], rows[:, _TOP_K], rows[:, _GREEDY] > 0 if any_greedy else None,
                      rows[:, _U_NUCLEUS:_U_RESAMPLE + 1], rows[:, _WINDOW:], rows[:, _REPEAT_MIN], max_top_k)


def ras_sample(logits: torch.Tensor, history: list[int], params: SamplingParams, generator: torch.Generator) -> int:
    """One id from `logits` [V] (logits or log-probs; -inf = masked): `ras_select` for one row, taking two uniforms
    from `generator`. Greedy: argmax (the uniforms are still drawn)."""
    scores = logits.float()[None]
    u = torch.rand(2, generator=generator, device=generator.device).tolist()
    window = history[-params.win_size:]
    flat = u + [params.top_p, params.top_k, _repeat_min(params), params.greedy, 0] + window
    return int(_select(scores, _upload(flat, 1, scores.device), params.top_k)[0])


# ---------------------------------------------------------------- per-request policy

_NO_STOP_MASK, _MASK_FIRST_STOP, _MASK_ALL_STOPS = 0, 1, 2


class TokenPolicy:
    """Per-request decoding state: length limits, stop ids, RAS history and the silent-token run filter.

    `step(logits)` samples the next id and returns `(token, finished)`: `token` is the id to emit, or None when
    the sampled id was a stop id or a dropped silent token. While not finished, `next_input` is the id to feed back
    to the LM (the sampled one, even when it was dropped from the output). `step` is `sample_batch` for one row;
    `accept(id)` is its host-side bookkeeping. Random draws: two uniforms per step from the request's own CPU
    generator (seeded by `params.seed`), so a request's tokens do not depend on the rows batched with it."""

    def __init__(self, text_len: int, params: SamplingParams | None = None,
                 speech_token_size: int = SPEECH_TOKEN_SIZE, num_special: int = NUM_SPECIAL,
                 mask_all_stops_before_min: bool = False):
        self.params = params = params if params is not None else SamplingParams()
        if params.force_tokens is None and params.max_tokens is None and (not isinstance(text_len, int) or text_len < 1):
            raise InputError(f"TokenPolicy: text_len must be a positive int (target text tokens), got {text_len!r}")
        self.text_len = text_len
        self.speech_token_size = speech_token_size
        self.vocab = speech_token_size + num_special
        self.mask_all_stops_before_min = mask_all_stops_before_min
        if params.force_tokens is not None:
            self.min_len = self.max_len = params.force_tokens
        else:
            self.min_len = params.min_tokens if params.min_tokens is not None else 2 * text_len
            self.max_len = params.max_tokens if params.max_tokens is not None else 20 * text_len
        self.history: list[int] = []      # every sampled speech id (RAS window, LM feedback)
        self.output: list[int] = []       # emitted ids (after the silent-run filter)
        self.silent_run = 0
        self.finished = False
        self.next_input: int | None = None
        self.generator: torch.Generator | None = None   # CPU, created on the first draw
        self._uniforms: list[float] = []                 # drawn, not yet used (DRAW_BLOCK steps at a time)

    @property
    def num_sampled(self) -> int:
        return len(self.history)

    def _generator(self) -> torch.Generator:
        if self.generator is None:
            self.generator = self.params.make_generator("cpu")
        return self.generator

    def draw(self) -> list[float]:
        """The two uniforms of this step [nucleus, resample]: the next two of the request's stream, which is drawn
        2 * DRAW_BLOCK at a time (the CPU generator gives the same numbers for one draw of 2n as for n draws of 2;
        the exactness test checks it)."""
        if not self._uniforms:
            self._uniforms = torch.rand(2 * DRAW_BLOCK, generator=self._generator()).tolist()[::-1]
        return [self._uniforms.pop(), self._uniforms.pop()]

    def undraw(self, uniforms: list[float]) -> None:
        """Give back `uniforms` (in the order `draw` gave them, the last ones drawn): the next `draw`s return them
        again. For a decode call that drew its steps' uniforms and then did not run (`PackedRows.undraw`)."""
        self._uniforms += uniforms[::-1]

    def stop_mask_mode(self, ahead: int = 0) -> int:
        """0: no stop id masked; 1: only `speech_token_size` (upstream ignore_eos quirk); 2: every stop id. `ahead`:
        the mode `ahead` steps from now, if none of them stops (a multi-step decode call, `pack_rows(steps=)`)."""
        n = self.num_sampled + ahead
        if self.params.force_tokens is not None or (self.mask_all_stops_before_min and n < self.min_len):
            return _MASK_ALL_STOPS
        if n < self.min_len:
            return _MASK_FIRST_STOP   # upstream ignore_eos quirk (see module docstring)
        return _NO_STOP_MASK

    def _check_logits(self, width: int) -> None:
        if width != self.vocab:
            raise InputError(f"TokenPolicy: logits have {width} entries, expected {self.vocab}")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probs [V] with the ids not allowed at this step set to -inf."""
        self._check_logits(logits.shape[-1])
        logp = logits.float().log_softmax(dim=-1)
        mode = self.stop_mask_mode()
        if mode == _MASK_ALL_STOPS:
            logp[self.speech_token_size:] = float("-inf")
        elif mode == _MASK_FIRST_STOP:
            logp[self.speech_token_size] = float("-inf")
        return logp

    def step(self, logits: torch.Tensor) -> tuple[int | None, bool]:
        """Sample and accept one id from `logits` [V] (exactly what `sample_batch` does for this row)."""
        if logits.dim() != 1:
            raise InputError(f"TokenPolicy.step: logits must be [V], got shape {tuple(logits.shape)}")
        return sample_batch(logits[None], [self])[0]

    def accept(self, tok: int) -> tuple[int | None, bool]:
        """Book-keep the sampled id `tok`: stop ids finish the request; length limits; silent-run filter.
        Returns `(token to emit or None, finished)`."""
        if self.finished:
            raise InputError("TokenPolicy.accept called after the request finished")
        if tok >= self.speech_token_size:
            self.finished = True
            self.next_input = None
            return None, True
        self.history.append(tok)
        self.next_input = tok
        emit: int | None = tok
        if self.params.force_tokens is None:
            if tok in _SILENT:
                self.silent_run += 1
                if self.silent_run > MAX_SILENT_RUN:
                    emit = None
            else:
                self.silent_run = 0
        if emit is not None:
            self.output.append(emit)
        if self.num_sampled >= self.max_len:
            self.finished = True
        return emit, self.finished


@dataclass
class PackedRows:
    """The host side of one sampling step for B rows (`pack_rows`): every row's two uniforms (already drawn from its
    generator), top_p / top_k / repeat_min / greedy / stop mode and RAS window, row-major in `flat` ([B, 7 + width]
    float32 once uploaded), and what the tensor ops need to know on the host. `steps` > 1: that many such blocks one
    after the other, one per step of a multi-step decode call (each with its own uniforms and stop mode; the window
    columns of the later blocks repeat the first's: the device keeps the window from there)."""
    flat: list[float]
    rows: int
    width: int          # window columns (the widest win_size; shorter windows padded with -1)
    max_top_k: int
    modes: set
    any_greedy: bool
    stop: int           # speech_token_size: the first stop id
    steps: int = 1

    def undraw(self, policies: list["TokenPolicy"]) -> None:
        """Give every row's uniforms back to its policy (`TokenPolicy.undraw`), for a call that did not run: the
        rows' next steps draw them again, so their tokens stay the ones a run without that call gives."""
        c = _WINDOW + self.width
        for i, p in enumerate(policies):
            p.undraw([u for k in range(self.steps) for u in
                      self.flat[(k * self.rows + i) * c + _U_NUCLEUS:(k * self.rows + i) * c + _U_RESAMPLE + 1]])

    def upload(self, device: torch.device) -> torch.Tensor:
        return _upload(self.flat, self.rows, device)

    def subset(self, keep: list[int]) -> "PackedRows":
        """The packed values of rows `keep` (their uniforms as drawn: a retry of fewer rows draws nothing anew; the
        sorted head keeps the whole batch's `max_top_k`, as the batch would have had)."""
        c = _WINDOW + self.width
        flat = [v for i in keep for v in self.flat[i * c:(i + 1) * c]]
        modes = {int(flat[j * c + _STOP_MODE]) for j in range(len(keep))}
        return PackedRows(flat, len(keep), self.width, self.max_top_k, modes,
                          any(flat[j * c + _GREEDY] > 0 for j in range(len(keep))), self.stop)


def pack_rows(policies: list[TokenPolicy], vocab: int, steps: int = 1) -> PackedRows:
    """Check every policy first (so a bad one draws nothing), then draw each row's two uniforms and pack its host
    values. Does not touch the policies' bookkeeping (that is `TokenPolicy.accept`). `steps` > 1: a block per step of
    a multi-step decode call, step k with the rows' next uniforms and their stop mode k steps ahead (the uniforms
    drawn in the order single steps draw them: row by row within a step, each row's own stream)."""
    stop = policies[0].speech_token_size
    width = max_top_k = 0
    for p in policies:
        if p.finished:
            raise InputError("TokenPolicy: sampling requested after the request finished")
        p._check_logits(vocab)
        if p.speech_token_size != stop:
            raise InputError(f"sample_ids: policies disagree on speech_token_size "
                             f"{sorted({p.speech_token_size for p in policies})}")
        width, max_top_k = max(width, p.params.win_size), max(max_top_k, p.params.top_k)
    flat: list[float] = []
    modes: set[int] = set()
    any_greedy = False
    for k in range(steps):
        for p in policies:
            params, mode = p.params, p.stop_mask_mode(k)
            modes.add(mode)
            any_greedy |= params.greedy
            window = p.history[-params.win_size:]
            flat += p.draw()
            flat += (params.top_p, params.top_k, _repeat_min(params), params.greedy, mode)
            if len(window) < width:
                flat += [-1] * (width - len(window))
            flat += window
    return PackedRows(flat, len(policies), width, max_top_k, modes, any_greedy, stop, steps)


def select_packed(logits: torch.Tensor, packed: PackedRows) -> list[int]:
    """The ids of `pack_rows`'s rows from their logits [B, V]: one upload, the tensor ops, ONE host sync."""
    rows = packed.upload(logits.device)
    return ids_to_host(_select(_masked_scores(logits, rows, packed.modes, packed.stop), rows, packed.max_top_k,
                               packed.any_greedy))


def sample_ids(logits: torch.Tensor, policies: list[TokenPolicy]) -> list[int]:
    """The next id of every row of `logits` [B, V] (row i belongs to `policies[i]`): stop masks, RAS with each row's
    own top_p / top_k / greedy / window and two uniforms from its own generator, in one set of tensor ops, one
    upload of the host values and ONE host sync (the final `.tolist()`). Does not touch the policies' bookkeeping
    (that is `TokenPolicy.accept`)."""
    _check_batch("sample_ids", logits, policies)
    if not policies:
        return []
    packed = pack_rows(policies, logits.shape[1])
    try:
        return select_packed(logits, packed)
    except Exception:  # the uniforms go back: a retry (row by row) draws what this call drew
        packed.undraw(policies)
        raise


# ---------------------------------------------------------------- the same, in fixed shapes (inside a CUDA graph)

class StaticSampler:
    """`select_packed` as shape-static, branch-free tensor ops that a CUDA graph can hold (captured after the AR
    decode step, so a step is one replay and one read of the ids): every row goes through the per-row stop-mode mask
    and the greedy `where`, the repeat resample is computed for every row, the window has a fixed `width` and the
    sorted head a fixed `top_k`. A batch it `fits` gets exactly `select_packed`'s ids (the masks and `where`s it
    adds select what the specialised ops would; tests/test_sampling_exact.py checks it); other batches sample from
    the logits as before. `rows(packed, B)` pads the packed host values to the static width and to B rows (padding
    rows: greedy, no stop mask)."""

    def __init__(self, vocab: int, stop: int, top_k: int = SamplingParams.top_k,
                 width: int = SamplingParams.win_size):
        self.vocab, self.stop, self.top_k, self.width = vocab, stop, top_k, width

    def fits(self, packed: PackedRows) -> bool:
        return packed.stop == self.stop and packed.max_top_k == self.top_k and packed.width <= self.width

    def holds(self, policy: TokenPolicy) -> bool:
        """Can this row sample in a multi-step decode call here: its stop ids, its top_k at most the static one and
        its RAS window exactly the static width (the device shifts each step's id into the window; a narrower one
        would keep ids it should drop)."""
        return (policy.speech_token_size == self.stop and policy.params.win_size == self.width
                and policy.params.top_k <= self.top_k)

    def fits_steps(self, policies: list[TokenPolicy]) -> bool:
        """Can these rows sample a multi-step decode call here (`ar_graphs.decode_steps`), checked before anything is
        drawn: `fits` — every row `holds`, the batch's largest top_k the static one."""
        return bool(policies) and all(self.holds(p) for p in policies) \
            and max(p.params.top_k for p in policies) == self.top_k

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """ids [B] (long) of `logits` [B, V] with the host values `rows` [B, 7 + width] (float32)."""
        scores = _masked_scores(logits, rows, {_NO_STOP_MASK, _MASK_FIRST_STOP}, self.stop)  # per-row mode column
        return ras_select(scores, rows[:, _TOP_P], rows[:, _TOP_K], rows[:, _GREEDY] > 0,
                          rows[:, _U_NUCLEUS:_U_RESAMPLE + 1], rows[:, _WINDOW:], rows[:, _REPEAT_MIN],
                          self.top_k, repeated_only=False)

    def rows(self, packed: PackedRows, B: int, pin: bool = False) -> torch.Tensor:
        """`packed`'s host values as a [B, 7 + width] float32 CPU tensor (pinned with `pin`): each window padded with
        -1 to the static width (-1 is never an id: the repeat counts do not change), then B - rows padding rows.
        A multi-step `packed` ([K, B, 7 + width]): the same for each step's block."""
        c, extra = _WINDOW + packed.width, [-1.0] * (self.width - packed.width)
        pad = ([0.5, 0.5, 1.0, self.top_k, 1 << 20, 1, _NO_STOP_MASK] + [-1.0] * self.width) * (B - packed.rows)
        flat: list[float] = []
        for k in range(packed.steps):
            for i in range(k * packed.rows * c, (k + 1) * packed.rows * c, c):
                flat += packed.flat[i:i + _WINDOW]
                flat += extra
                flat += packed.flat[i + _WINDOW:i + c]
            flat += pad
        shape = (B, _WINDOW + self.width) if packed.steps == 1 else (packed.steps, B, _WINDOW + self.width)
        return torch.tensor(flat, dtype=torch.float32, pin_memory=pin).view(shape)

    def example_rows(self, B: int, steps: int = 1) -> torch.Tensor:
        return self.rows(PackedRows([], 0, self.width, self.top_k, set(), False, self.stop, steps), B)


def _masked_scores(logits: torch.Tensor, rows: torch.Tensor, modes: set[int], stop: int) -> torch.Tensor:
    """float32 scores with each row's stop ids at -inf (mode 1: id `stop`, mode 2: ids >= `stop`); `logits` itself
    is not changed. One fill when every row has the same mode; the rows' mode column (on the device) otherwise."""
    if modes == {_NO_STOP_MASK} or stop >= logits.shape[1]:
        return logits.float()
    scores = logits.to(torch.float32, copy=True)
    if len(modes) == 1:
        if _MASK_ALL_STOPS in modes:
            scores[:, stop:] = float("-inf")
        else:
            scores[:, stop] = float("-inf")
        return scores
    mode = rows[:, _STOP_MODE:_STOP_MODE + 1]
    tail = scores[:, stop:]
    first = _arange(tail.shape[1], tail.device)[None] == 0
    tail.masked_fill_((mode == _MASK_ALL_STOPS) | ((mode == _MASK_FIRST_STOP) & first), float("-inf"))
    return scores


def sample_batch(logits: torch.Tensor, policies: list[TokenPolicy]) -> list[tuple[int | None, bool]]:
    """One decode step for B requests: `draw_batch` (one host sync), then each policy's `book`. A row already at
    max_len finishes without a draw. Returns `(token to emit or None, finished)` per row."""
    return [book(p, tok) for p, tok in zip(policies, draw_batch(logits, policies))]


def draw_batch(logits: torch.Tensor, policies: list[TokenPolicy]) -> list[int | None]:
    """`sample_batch`'s draw, nothing booked: each row's sampled id (`sample_ids`), None for a row already at max_len
    (it finishes without a draw). If it raises, no row has drawn anything (its uniforms were given back)."""
    _check_batch("sample_batch", logits, policies)
    live = [i for i, p in enumerate(policies) if p.finished or p.num_sampled < p.max_len]
    ids = sample_ids(logits if len(live) == len(policies) else logits[live], [policies[i] for i in live])
    out: list[int | None] = [None] * len(policies)
    for i, tok in zip(live, ids):
        out[i] = tok
    return out


def book(policy: TokenPolicy, tok: int | None) -> tuple[int | None, bool]:
    """`sample_batch`'s bookkeeping of one row's `draw_batch` id: `accept(tok)`; None: the row is at max_len and
    finishes."""
    if tok is None:
        policy.finished = True
        return None, True
    return policy.accept(tok)


def _check_batch(what: str, logits: torch.Tensor, policies: list[TokenPolicy]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(policies):
        raise InputError(f"{what}: logits must be [{len(policies)}, V] for {len(policies)} policies, "
                         f"got shape {tuple(logits.shape)}")


def generate(lm, lm_input: torch.Tensor, text_len: int, params: SamplingParams | None = None,
             **policy_kwargs) -> Iterator[int]:
    """Single-request decode loop on a 1-slot cache (slot 0): prefill `lm_input` [L, H], then one token per step.
    Yields the emitted speech ids. (Re)allocates the cache only when it is missing or too short."""
    policy = TokenPolicy(text_len, params, lm.config.speech_token_size, **policy_kwargs)
    if lm_input.dim() != 2:
        raise InputError(f"generate: lm_input must be [L, H], got shape {tuple(lm_input.shape)}")
    length = lm_input.shape[0]
    need = length + policy.max_len
    shape = lm.cache_shape
    if shape is None or shape[1] < need:
        lm.setup_cache(1, -(-need // 256) * 256)
    dev = lm.device
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    with torch.inference_mode():
        logits = lm.prefill(lm_input[None].to(device=dev, dtype=lm.dtype),
                            torch.tensor([length], device=dev), slots)
    pos = length
    while True:
        tok, done = policy.step(logits[0])
        if tok is not None:
            yield tok
        if done:
            return
        with torch.inference_mode():
            logits = lm.decode(torch.tensor([policy.next_input], device=dev), slots,
                               torch.tensor([pos], device=dev))
        pos += 1
