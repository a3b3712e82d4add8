"""CosyVoice3 flow stage (speech tokens -> mel): CausalMaskedDiffWithDiT + CausalConditionalCFM, eager PyTorch.

Split into reusable steps so the runtime can batch rows and plug in a compiled estimator:
`prepare_row` (per-row conditioning) -> `collate` (right-pad rows) -> `solve` (10 Euler steps with CFG) -> crop.
`inference` is the single-request, golden-parity entry point; `inference_batch` runs ragged rows in one solve.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import expected_shapes, load_strict, read_state_dict
from .config import FlowConfig
from .dit import DiT
from ...engines.errors import InputError, RequestTooLongError

# Upstream draws `torch.randn([1, 80, 50 * 300])` right after set_all_random_seed(0); drawing the same size keeps
# the default buffer identical to upstream's over its first 15000 frames.
UPSTREAM_NOISE_FRAMES = 15000

Estimator = Callable[..., torch.Tensor]


class PreLookaheadLayer(nn.Module):
    """conv1 (kernel look_ahead+1, right context) -> leaky_relu -> left-pad -> conv2 (kernel 3) -> + input."""

    def __init__(self, in_channels: int, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    def forward(self, inputs: torch.Tensor, context: Optional[torch.Tensor] = None) -> torch.Tensor:
        """inputs [B, L, C]; context [B, look_ahead, C] (the look-ahead tokens) or None for zero padding."""
        h = inputs.transpose(1, 2)
        if context is None:
            h = F.pad(h, (0, self.pre_lookahead_len))
        else:
            h = torch.cat((h, context.transpose(1, 2)), dim=2)
        h = F.leaky_relu(self.conv1(h))
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + inputs


class CFMDecoder(nn.Module):
    """Holds the estimator under `decoder.estimator` (the released key layout)."""

    def __init__(self, estimator: DiT):
        super().__init__()
        self.estimator = estimator


@dataclass
class FlowInput:
    """One request row: token [N], prompt_token [P], prompt_feat [2P, 80], embedding [192] (no batch dims)."""
    token: torch.Tensor
    prompt_token: torch.Tensor
    prompt_feat: torch.Tensor
    embedding: torch.Tensor
    finalize: bool = True
    # streaming prefix cache of the request (stages.flow_cache.FlowPrefixState): `stages.flow_cache.flow_rows` runs a
    # non-final streaming row with one over its new frames only; `Flow.inference_batch` ignores it (whole history)
    cache: Optional[object] = None
    # Host-side facts a caller (the scheduler's DiT worker) already knows, so a DiT call needs no device->host sync:
    # `ids_checked` (every token id was checked against the vocabulary on the host), `host_ids` (prompt + generated
    # token ids on the CPU) and `prompt_digest` (stages.flow_cache.prompt_digest of the prompt tensors)
    ids_checked: bool = False
    host_ids: Optional[torch.Tensor] = None
    prompt_digest: Optional[str] = None
    # a cached hop may write its new frames' K/V to the request's prefix (False: the last hop before the final, which
    # is a full-attention pass that reads no prefix; the hop's own output is the same either way)
    commit: bool = True


@dataclass
class FlowRow:
    """Per-row conditioning from `prepare_row`: mu/cond [80, T], spks [80], T frames of which prompt_frames prompt."""
    mu: torch.Tensor
    cond: torch.Tensor
    spks: torch.Tensor
    frames: int
    prompt_frames: int


def _default_noise(frames: int) -> torch.Tensor:
    """Upstream's fixed CFM noise: randn([1, 80, 15000]) from seed 0, extended by further draws if longer."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randn([1, 80, UPSTREAM_NOISE_FRAMES], generator=g, device="cpu")
    if frames > UPSTREAM_NOISE_FRAMES:
        extra = torch.randn([1, 80, frames - UPSTREAM_NOISE_FRAMES], generator=g, device="cpu")
        noise = torch.cat((noise, extra), dim=2)
    return noise[:, :, :frames].contiguous()


class Flow(nn.Module):
    """Tokens -> mel. State-dict keys are exactly the released `flow.pt`."""

    def __init__(self, cfg: FlowConfig):
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_channels, cfg.pre_lookahead_len)
        self.decoder = CFMDecoder(DiT(cfg.dit))
        device = self.input_embedding.weight.device
        if device.type == "meta":
            noise = torch.empty([1, cfg.output_size, cfg.max_mel_frames], device=device)
        else:
            noise = _default_noise(cfg.max_mel_frames).to(device)
        self.register_buffer("rand_noise", noise, persistent=False)

    # ------------------------------------------------------------------------------------------ checkpoint / noise

    @property
    def estimator(self) -> DiT:
        return self.decoder.estimator

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every key and shape of this config's `flow.pt` (rand_noise is not in it)."""
        return expected_shapes(self)

    def load_checkpoint(self, sd: Union[str, Mapping[str, torch.Tensor]]) -> "Flow":
        """Load a released-layout state dict (or a path to one); CheckpointError names any bad key."""
        if isinstance(sd, str):
            sd = read_state_dict(sd)
        load_strict(self, sd, "flow")
        return self

    def set_noise(self, noise: torch.Tensor) -> None:
        """Replace the fixed CFM noise with `noise` [1, 80, F] or [80, F] (any F >= 1)."""
        if noise.ndim == 2:
            noise = noise.unsqueeze(0)
        if noise.ndim != 3 or noise.shape[0] != 1 or noise.shape[1] != self.cfg.output_size or noise.shape[2] < 1:
            raise InputError(f"flow noise must have shape [1, {self.cfg.output_size}, frames], "
                             f"got {tuple(noise.shape)}")
        self.rand_noise = noise.detach().to(device=self.rand_noise.device, dtype=self.rand_noise.dtype).contiguous()

    @property
    def max_frames(self) -> int:
        """Most mel frames (prompt + output) a request may have: the length of the noise buffer."""
        return self.rand_noise.shape[2]

    def _check_frames(self, frames: int, prompt_frames: Optional[int] = None) -> None:
        if frames > self.max_frames:
            detail = "" if prompt_frames is None else f" ({prompt_frames} prompt + {frames - prompt_frames} output)"
            raise RequestTooLongError(f"flow request needs {frames} mel frames{detail}, but the fixed CFM noise "
                                      f"buffer holds only {self.max_frames}")

    # ------------------------------------------------------------------------------------------------- per row

    @torch.inference_mode()
    def prepare_row(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                    embedding: torch.Tensor, finalize: bool, ids_checked: bool = False) -> FlowRow:
        """Per-row conditioning: token [N], prompt_token [P], prompt_feat [2P, 80], embedding [192].

        Not finalize: the last `pre_lookahead_len` tokens are only PreLookahead context and give no frames.
        Finalize: the look-ahead is zero padding. Tokens -> mel frames x token_mel_ratio. `ids_checked`: the caller
        checked every id against the vocabulary on the host (`check_token_ids`), so the check here, which reads
        device tensors back (a sync), is skipped."""
        cfg = self.cfg
        device, dtype = self.rand_noise.device, self.rand_noise.dtype
        token = _as_1d(token, "token").to(device)
        prompt_token = _as_1d(prompt_token, "prompt_token").to(device)
        if prompt_feat.ndim == 3 and prompt_feat.shape[0] == 1:
            prompt_feat = prompt_feat[0]
        if prompt_feat.ndim != 2 or prompt_feat.shape[1] != cfg.output_size:
            raise InputError(f"prompt_feat must have shape [frames, {cfg.output_size}], got {tuple(prompt_feat.shape)}")
        embedding = embedding.reshape(-1) if embedding.ndim == 2 and embedding.shape[0] == 1 else embedding
        if embedding.ndim != 1 or embedding.shape[0] != cfg.spk_embed_dim:
            raise InputError(f"embedding must have shape [{cfg.spk_embed_dim}], got {tuple(embedding.shape)}")

        tokens = torch.cat((prompt_token, token)).long()
        n_tokens = tokens.shape[0]
        look_ahead = cfg.pre_lookahead_len
        n_frame_tokens = n_tokens if finalize else n_tokens - look_ahead
        if n_frame_tokens < 1:
            raise InputError(f"flow row has {n_tokens} tokens; a non-final call needs more than the {look_ahead} "
                             f"look-ahead tokens" if not finalize else "flow row has no tokens")
        if n_tokens and not ids_checked:
            check_token_ids(tokens, cfg.vocab_size)
        frames = n_frame_tokens * cfg.token_mel_ratio
        prompt_frames = prompt_feat.shape[0]
        self._check_frames(frames, prompt_frames)
        if prompt_frames >= frames:
            raise InputError(f"prompt_feat has {prompt_frames} frames but the row gives only {frames} mel frames; "
                             f"no output frames would remain")

        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(device=device, dtype=dtype), dim=0))
        emb = self.input_embedding(tokens).to(dtype).unsqueeze(0)  # [1, L, 80]
        if finalize:
            h = self.pre_lookahead_layer(emb)
        else:
            h = self.pre_lookahead_layer(emb[:, :-look_ahead], context=emb[:, -look_ahead:])
        mu = h[0].repeat_interleave(cfg.token_mel_ratio, dim=0).transpose(0, 1)  # [80, T]
        cond = torch.zeros_like(mu)
        cond[:, :prompt_frames] = prompt_feat.to(device=device, dtype=dtype).transpose(0, 1)
        return FlowRow(mu=mu, cond=cond, spks=spks, frames=frames, prompt_frames=prompt_frames)

    @staticmethod
    def collate(rows: Sequence[FlowRow], pad_to: Optional[int] = None):
        """Right-pad rows to one batch: (mu [B,80,T], mask [B,1,T], spks [B,80], cond [B,80,T])."""
        if not rows:
            raise InputError("flow batch has no rows")
        T = max(r.frames for r in rows)
        if pad_to is not None:
            if pad_to < T:
                raise InputError(f"pad_to={pad_to} is shorter than the longest row ({T} frames)")
            T = pad_to
        ref = rows[0].mu
        B = len(rows)
        mu = ref.new_zeros(B, ref.shape[0], T)
        cond = ref.new_zeros(B, ref.shape[0], T)
        mask = ref.new_zeros(B, 1, T)
        for i, r in enumerate(rows):
            mu[i, :, :r.frames] = r.mu
            cond[i, :, :r.frames] = r.cond
            mask[i, :, :r.frames] = 1
        spks = torch.stack([r.spks for r in rows])
        return mu, mask, spks, cond

    # --------------------------------------------------------------------------------------------------- solver

    def time_span(self, device=None, dtype=torch.float32) -> torch.Tensor:
        """Cosine schedule t = 1 - cos(linspace(0, 1, n+1) * pi/2)."""
        t = torch.linspace(0, 1, self.cfg.n_timesteps + 1, device=device, dtype=dtype)
        return 1 - torch.cos(t * 0.5 * math.pi)

    @torch.inference_mode()
    def solve(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              streaming: bool = False, estimator: Optional[Estimator] = None) -> torch.Tensor:
        """Euler ODE from `rand_noise[:, :, :T]` (every row), CFG as one estimator call on 2B rows.

        The 2B rows are [conditional rows; the same rows with mu/spks/cond zeroed], as upstream.
        `estimator(x, mask, mu, t, spks, cond, streaming=...)` defaults to this flow's DiT; pass a compiled engine
        wrapper with the same call signature to swap it. Returns mel [B, 80, T] in float32."""
        B, C, T = mu.shape
        self._check_frames(T)
        if estimator is None:
            estimator = self.estimator
        cfg_rate = self.cfg.inference_cfg_rate
        x = self.rand_noise[:, :, :T].to(device=mu.device, dtype=mu.dtype).expand(B, C, T)
        t_span = self.time_span(mu.device, mu.dtype)

        # Static 2B-row inputs: conditional rows first, then the unconditional (zeroed) rows.
        mask_in = torch.cat((mask, mask)).to(mu.dtype)
        mu_in = torch.cat((mu, torch.zeros_like(mu)))
        spks_in = torch.cat((spks, torch.zeros_like(spks))).to(mu.dtype)
        cond_in = torch.cat((cond, torch.zeros_like(cond))).to(mu.dtype)
        x_in = torch.empty((2 * B, C, T), device=mu.device, dtype=mu.dtype)

        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            x_in[:B] = x
            x_in[B:] = x
            t_in = t.expand(2 * B).contiguous()
            v = estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming=streaming)
            x, t, dt = cfg_euler_step(x, v, t, dt, step, t_span, cfg_rate)
        return x.float()

    # --------------------------------------------------------------------------------------------- entry points

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True,
                  estimator: Optional[Estimator] = None) -> torch.Tensor:
        """token [1, N], prompt_token [1, P], prompt_feat [1, 2P, 80], embedding [1, 192] -> mel [1, 80, T_out]."""
        for name, tsr in (("token", token), ("prompt_token", prompt_token), ("prompt_feat", prompt_feat),
                          ("embedding", embedding)):
            if tsr.ndim < 2 or tsr.shape[0] != 1:
                raise InputError(f"flow.inference takes batch 1: {name} has shape {tuple(tsr.shape)}")
        row = self.prepare_row(token[0], prompt_token[0], prompt_feat[0], embedding[0], finalize)
        mu, mask, spks, cond = self.collate([row])
        mel = self.solve(mu, mask, spks, cond, streaming, estimator)
        return mel[:, :, row.prompt_frames:row.frames]

    @torch.inference_mode()
    def inference_batch(self, rows: Sequence[Union[FlowInput, tuple]], streaming: bool = False,
                        finalize: Union[bool, Sequence[bool], None] = None, pad_to: Optional[int] = None,
                        estimator: Optional[Estimator] = None) -> list[torch.Tensor]:
        """Ragged rows (FlowInput or (token, prompt_token, prompt_feat, embedding[, finalize]) without batch dims),
        right-padded into one solve. `finalize` (one bool or one per row) overrides the rows' own flags.
        Returns one mel [1, 80, T_out_i] per row, equal to running the row alone."""
        rows = [r if isinstance(r, FlowInput) else FlowInput(*r) for r in rows]
        if isinstance(finalize, bool):
            flags = [finalize] * len(rows)
        elif finalize is None:
            flags = [r.finalize for r in rows]
        else:
            flags = list(finalize)
            if len(flags) != len(rows):
                raise InputError(f"finalize has {len(flags)} flags for {len(rows)} rows")
        prepared = [self.prepare_row(r.token, r.prompt_token, r.prompt_feat, r.embedding, f, r.ids_checked)
                    for r, f in zip(rows, flags)]
        mu, mask, spks, cond = self.collate(prepared, pad_to)
        mel = self.solve(mu, mask, spks, cond, streaming, estimator)
        return [mel[i:i + 1, :, r.prompt_frames:r.frames] for i, r in enumerate(prepared)]


def cfg_euler_step(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, dt: torch.Tensor, step: int,
                   t_span: torch.Tensor, cfg_rate: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Euler step `step` (1-based) of the CFG flow ODE, as upstream's solver does it: `v` holds the estimator's
    conditional rows then its unconditional rows; v = (1 + r) v_cond - r v_uncond, x + dt v; then t and the next dt
    from the schedule. Returns (x, t, dt). Every solver here (whole, prefix-cached) steps through this."""
    B = x.shape[0]
    v_cond, v_uncond = torch.split(v, [B, B], dim=0)
    v = (1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond
    x = x + dt * v
    t = t + dt
    if step < len(t_span) - 1:
        dt = t_span[step + 1] - t
    return x, t, dt


def check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """InputError unless every speech token id lies in [0, vocab_size) (an id outside it would index the embedding
    table out of bounds: on CUDA a device-side assert that takes every request on the GPU down)."""
    if tokens.numel() and bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise InputError(f"speech token ids must lie in [0, {vocab_size}), got min {int(tokens.min())} "
                         f"max {int(tokens.max())}")


def _as_1d(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.ndim == 2 and x.shape[0] == 1:
        x = x[0]
    if x.ndim != 1:
        raise InputError(f"{name} must be a 1-D tensor of token ids, got shape {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise InputError(f"{name} must hold integer token ids, got dtype {x.dtype}")
    return x
