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

All random draws use one per-request `torch.Generator`, so a seed reproduces the output (on the same device).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from .config import NUM_SPECIAL, SILENT_TOKENS, SPEECH_TOKEN_SIZE
from .errors import InputError

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


def _nucleus_count(sorted_probs: torch.Tensor, top_p: float, top_k: int) -> int:
    """How many of the descending probs upstream keeps: while cum_prob < top_p and count < top_k, adding in fp32."""
    head = sorted_probs[:top_k].float().cpu().numpy()
    limit = np.float32(top_p)
    cum, n = np.float32(0.0), 0
    for p in head:
        if cum < limit and n < top_k:
            cum = np.float32(cum + p)
            n += 1
        else:
            break
    return n


def nucleus_sample(scores: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    probs = scores.softmax(dim=0)
    sorted_p, sorted_idx = probs.sort(descending=True, stable=True)
    n = _nucleus_count(sorted_p, top_p, top_k)
    pick = torch.multinomial(sorted_p[:n], 1, replacement=True, generator=generator)
    return int(sorted_idx[pick])


def random_sample(scores: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(scores.softmax(dim=0), 1, replacement=True, generator=generator))


def ras_sample(logits: torch.Tensor, history: list[int], params: SamplingParams, generator: torch.Generator) -> int:
    """One id from `logits` [V] (logits or log-probs; -inf = masked). Greedy: argmax. Otherwise nucleus sampling;
    if the drawn id occurs >= win_size * tau_r times in the last win_size ids of `history`, its score is set to
    -inf and an id is drawn from the full softmax (upstream `ras_sampling`)."""
    scores = logits.float()
    if params.greedy:
        return int(scores.argmax())
    top_id = nucleus_sample(scores, params.top_p, params.top_k, generator)
    window = history[-params.win_size:]
    if sum(1 for t in window if t == top_id) >= params.win_size * params.tau_r:
        scores = scores.clone()
        scores[top_id] = float("-inf")
        top_id = random_sample(scores, generator)
    return top_id


class TokenPolicy:
    """Per-request decoding state: length limits, stop ids, RAS history and the silent-token run filter.

    `step(logits)` samples the next id and returns `(token, finished)`: `token` is the id to emit, or None when
    the sampled id was a stop id or a dropped silent token. While not finished, `next_input` is the id to feed back
    to the LM (the sampled one, even when it was dropped from the output)."""

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
        self.generator: torch.Generator | None = None

    @property
    def num_sampled(self) -> int:
        return len(self.history)

    def _generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = self.params.make_generator(device)
        return self.generator

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Log-probs [V] with the ids not allowed at this step set to -inf."""
        if logits.shape[-1] != self.vocab:
            raise InputError(f"TokenPolicy: logits have {logits.shape[-1]} entries, expected {self.vocab}")
        logp = logits.float().log_softmax(dim=-1)
        if self.params.force_tokens is not None or (self.mask_all_stops_before_min and self.num_sampled < self.min_len):
            logp[self.speech_token_size:] = float("-inf")
        elif self.num_sampled < self.min_len:
            logp[self.speech_token_size] = float("-inf")   # upstream ignore_eos quirk (see module docstring)
        return logp

    def step(self, logits: torch.Tensor) -> tuple[int | None, bool]:
        if self.finished:
            raise InputError("TokenPolicy.step called after the request finished")
        if self.num_sampled >= self.max_len:
            self.finished = True
            return None, True
        logp = self.mask(logits)
        tok = ras_sample(logp, self.history, self.params, self._generator(logp.device))
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
