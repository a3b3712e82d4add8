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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from .config import NUM_SPECIAL, SILENT_TOKENS, SPEECH_TOKEN_SIZE
from ...engines.errors import InputError

MAX_SILENT_RUN = 5
_SILENT = frozenset(SILENT_TOKENS)


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
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise InputError(f"SamplingParams.top_k must be a positive int, got {self.top_k!r}")
        if not isinstance(self.win_size, int) or self.win_size < 1:
            raise InputError(f"SamplingParams.win_size must be a positive int, got {self.win_size!r}")
        if self.tau_r <= 0:
            raise InputError(f"SamplingParams.tau_r must be > 0, got {self.tau_r!r}")
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

def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` [B, N] (>= 0, unnormalised) the index i with cdf[i-1] <= u * total < cdf[i], for
    uniforms `u` [B] in [0, 1): a draw proportional to the weights. Zero-weight entries are never picked (unless a
    row is all zeros). Returns [B, 1]."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)


def nucleus_keep(sorted_probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Which of the descending probs [B, N] upstream keeps: position i while the cumulative probability BEFORE it is
    < top_p and i < top_k (`top_p`, `top_k` [B]). Bool [B, N]; position 0 is always kept."""
    cum = sorted_probs.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    pos = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    return (before < top_p[:, None]) & (pos[None] < top_k[:, None])


def ras_select(scores: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, greedy: torch.Tensor,
               uniforms: torch.Tensor, window: torch.Tensor, repeat_min: torch.Tensor,
               max_top_k: int | None = None) -> torch.Tensor:
    """RAS for B rows at once, all tensors on one device, no host sync. Returns the ids [B] (long).

    scores [B, V] float (logits or log-probs, -inf = masked); top_p [B] float; top_k [B] long; greedy [B] bool;
    uniforms [B, 2] in [0, 1) (column 0: nucleus draw, column 1: repeat resample); window [B, W] long (the row's last
    win_size sampled ids, padded with -1); repeat_min [B]: the drawn id is resampled when it occurs >= repeat_min
    times in the window; max_top_k: a bound on top_k (python int) so only that many sorted probs are scanned.
    Greedy rows take the argmax. Otherwise inverse-CDF nucleus sampling; a repeated id is masked and an id is drawn
    from the full softmax of what is left (upstream `ras_sampling`)."""
    probs = scores.softmax(dim=-1)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    k = sorted_p.shape[-1] if max_top_k is None else min(max_top_k, sorted_p.shape[-1])
    head = sorted_p[:, :k]
    head = head * nucleus_keep(head, top_p, top_k)
    nucleus_id = sorted_idx.gather(1, _inverse_cdf(head, uniforms[:, 0]))                       # [B, 1]
    repeated = (window == nucleus_id).sum(dim=-1, keepdim=True) >= repeat_min[:, None]
    rest = scores.scatter(1, nucleus_id, float("-inf")).softmax(dim=-1)
    resample_id = _inverse_cdf(rest, uniforms[:, 1])
    ids = torch.where(repeated, resample_id, nucleus_id)
    ids = torch.where(greedy[:, None], scores.argmax(dim=-1, keepdim=True), ids)
    return ids[:, 0]


def _repeat_min(params: SamplingParams) -> int:
    """Smallest repeat count that triggers the resample: count >= win_size * tau_r (exact for integer counts)."""
    return math.ceil(params.win_size * params.tau_r)


def _draw_uniforms(generator: torch.Generator) -> torch.Tensor:
    """The two uniforms [2] one sampling step takes from a request's stream (drawn for greedy rows too)."""
    return torch.rand(2, generator=generator, device=generator.device).to("cpu")


# Host-side inputs of one row, uploaded as one float32 tensor [B, _WINDOW + W] (ids < 2**24 are exact in float32).
_U_NUCLEUS, _U_RESAMPLE, _TOP_P, _TOP_K, _REPEAT_MIN, _GREEDY, _STOP_MODE, _WINDOW = range(8)


def _row_params(params: SamplingParams, history: list[int], stop_mode: int, width: int) -> list[float]:
    """Columns _TOP_P.._STOP_MODE and the RAS window (the last win_size ids, left-padded with -1 to `width`)."""
    window = history[-params.win_size:]
    return ([params.top_p, params.top_k, _repeat_min(params), params.greedy, stop_mode]
            + [-1] * (width - len(window)) + window)


def _upload_rows(uniforms: torch.Tensor, params_rows: list[list[float]], device: torch.device) -> torch.Tensor:
    """[B, 2] uniforms + per-row params → one device tensor, without a host sync (pinned + non-blocking on CUDA)."""
    host = torch.cat([uniforms, torch.tensor(params_rows, dtype=torch.float32)], dim=1)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _select(scores: torch.Tensor, rows: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """`ras_select` with its inputs read from the uploaded row tensor."""
    return ras_select(scores, rows[:, _TOP_P], rows[:, _TOP_K].long(), rows[:, _GREEDY] > 0,
                      rows[:, _U_NUCLEUS:_U_RESAMPLE + 1], rows[:, _WINDOW:].long(), rows[:, _REPEAT_MIN], max_top_k)


def ras_sample(logits: torch.Tensor, history: list[int], params: SamplingParams, generator: torch.Generator) -> int:
    """One id from `logits` [V] (logits or log-probs; -inf = masked): `ras_select` for one row, taking two uniforms
    from `generator`. Greedy: argmax (the uniforms are still drawn)."""
    scores = logits.float()[None]
    rows = _upload_rows(_draw_uniforms(generator)[None], [_row_params(params, history, 0, params.win_size)],
                        scores.device)
    return int(_select(scores, rows, params.top_k)[0])


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

    @property
    def num_sampled(self) -> int:
        return len(self.history)

    def _generator(self) -> torch.Generator:
        if self.generator is None:
            self.generator = self.params.make_generator("cpu")
        return self.generator

    def stop_mask_mode(self) -> int:
        """0: no stop id masked; 1: only `speech_token_size` (upstream ignore_eos quirk); 2: every stop id."""
        if self.params.force_tokens is not None or (self.mask_all_stops_before_min and self.num_sampled < self.min_len):
            return _MASK_ALL_STOPS
        if self.num_sampled < self.min_len:
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


def sample_ids(logits: torch.Tensor, policies: list[TokenPolicy]) -> list[int]:
    """The next id of every row of `logits` [B, V] (row i belongs to `policies[i]`): stop masks, RAS with each row's
    own top_p / top_k / greedy / window and two uniforms from its own generator, in one set of tensor ops and ONE
    host sync (the final `.tolist()`). Does not touch the policies' bookkeeping (that is `TokenPolicy.accept`)."""
    _check_batch("sample_ids", logits, policies)
    if not policies:
        return []
    for p in policies:
        if p.finished:
            raise InputError("TokenPolicy: sampling requested after the request finished")
        p._check_logits(logits.shape[1])
    stop = policies[0].speech_token_size
    if any(p.speech_token_size != stop for p in policies):
        raise InputError(f"sample_ids: policies disagree on speech_token_size "
                         f"{sorted({p.speech_token_size for p in policies})}")
    width = max(p.params.win_size for p in policies)
    uniforms = torch.stack([_draw_uniforms(p._generator()) for p in policies])
    dev = logits.device
    rows = _upload_rows(uniforms, [_row_params(p.params, p.history, p.stop_mask_mode(), width) for p in policies], dev)
    mode = rows[:, _STOP_MODE:_STOP_MODE + 1]
    col = torch.arange(logits.shape[1], device=dev)[None]
    masked = ((mode == _MASK_ALL_STOPS) & (col >= stop)) | ((mode == _MASK_FIRST_STOP) & (col == stop))
    scores = logits.float().masked_fill(masked, float("-inf"))
    return _select(scores, rows, max(p.params.top_k for p in policies)).tolist()


def sample_batch(logits: torch.Tensor, policies: list[TokenPolicy]) -> list[tuple[int | None, bool]]:
    """One decode step for B requests: `sample_ids` (one host sync), then each policy's `accept`. A row already at
    max_len finishes without a draw. Returns `(token to emit or None, finished)` per row."""
    _check_batch("sample_batch", logits, policies)
    live = [i for i, p in enumerate(policies) if p.finished or p.num_sampled < p.max_len]
    ids = sample_ids(logits if len(live) == len(policies) else logits[live], [policies[i] for i in live])
    out: list[tuple[int | None, bool]] = [(None, True)] * len(policies)
    for p in policies:
        if not p.finished and p.num_sampled >= p.max_len:
            p.finished = True
    for i, tok in zip(live, ids):
        out[i] = policies[i].accept(tok)
    return out


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
