"""CosyVoice3 flow estimator: the DiT (F5-TTS style) that predicts the CFM velocity.

State-dict keys match the released `flow.pt` under `decoder.estimator.`. The forward takes the upstream estimator
signature `(x, mask, mu, t, spks, cond, streaming)` on [B, C, T] tensors. Masks are built with tensor ops only (no host
sync, no data-dependent branches), so the module can be captured in CUDA graphs and exported with dynamic B and T.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import dit_conv
from .config import DiTConfig
from .hop_attention import hop_attention, prefix_mask


# ------------------------------------------------------------------------------------------------------------- masks

def attention_mask(mask: torch.Tensor, streaming: bool, chunk_size: int) -> torch.Tensor:
    """Bool attention mask [B, 1, T, T] (True = may attend) from the key padding mask [B, 1, T].

    Offline: every query sees all valid keys. Streaming: block-causal in `chunk_size` frames with all left chunks.
    A query row with no allowed key (an all-padding row) is opened to every key, as upstream does, so SDPA gives no NaN.
    """
    valid = mask.bool()  # [B, 1, T]
    T = valid.shape[-1]
    keys = valid.unsqueeze(2)  # [B, 1, 1, T]
    if streaming:
        pos = torch.arange(T, device=mask.device)
        chunk_end = (torch.div(pos, chunk_size, rounding_mode="floor") + 1) * chunk_size
        block_causal = pos.unsqueeze(0) < chunk_end.unsqueeze(1)  # [T(query), T(key)]
        allowed = keys & block_causal
    else:
        allowed = keys.expand(-1, -1, T, -1)
    empty_row = ~allowed.any(dim=-1, keepdim=True)
    return allowed | empty_row


# ---------------------------------------------------------------------------------------------------------- embeddings

class TimestepEmbedding(nn.Module):
    """Sinusoidal embedding of t (scale 1000, 256 features) then Linear-SiLU-Linear."""

    def __init__(self, dim: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        step = math.log(10000) / (half - 1)
        freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -step)
        args = 1000.0 * t.float().unsqueeze(1) * freqs.unsqueeze(0)
        emb = torch.cat((args.sin(), args.cos()), dim=-1).to(t.dtype)
        return self.time_mlp(emb)


@torch.library.custom_op("cosytrt::dit_conv1d", mutates_args=())
def _opaque_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int) -> torch.Tensor:
    return dit_conv.opaque_conv(x, weight, bias, groups)


@_opaque_conv1d.register_fake
def _(x, weight, bias, groups):
    return x.new_empty(x.shape[0], weight.shape[0], x.shape[2] - weight.shape[2] + 1)


def _sdpa(q, k, v, attn_mask):
    backends = dit_conv.SDPA_BACKENDS[dit_conv.SDPA]
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends):  # COSYTRT_DIT_SDPA (dit_conv.py)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def _conv1d(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """`conv(x)` (no padding, stride 1). Under torch.compile the convolution is an opaque op: the framework's own
    shape propagation for convolutions picks a backend from the (symbolic) batch size and so guards on it (seen:
    `batch >= 16`), which costs a second full compile of the DiT per mode. Export (ONNX, AOTInductor) and eager
    see the plain convolution. Which kernel runs it on a device: `dit_conv.pick` (channels-last conv2d on CUDA);
    when the op is used: `dit_conv.opaque_under_compile` (always for an explicit choice, the Triton conv's included;
    for the default only where the torch version's Dynamo does not fold `is_exporting()` to True)."""
    if torch.compiler.is_compiling() and dit_conv.opaque_under_compile():
        return _opaque_conv1d(x, conv.weight, conv.bias, conv.groups)
    return dit_conv.pick(x)(x, conv.weight, conv.bias, conv.groups)


class CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convolutions (kernel 31, 16 groups) with Mish."""

    def __init__(self, dim: int, kernel_size: int = 31, groups: int = 16):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        x = x.transpose(1, 2)
        for conv, act in (self.conv1, self.conv2):
            x = act(_conv1d(conv, F.pad(x, (self.kernel_size - 1, 0))))
        return x.transpose(1, 2)

    def forward_cached(self, x: torch.Tensor, tail1: torch.Tensor, tail2: torch.Tensor):
        """The same convolutions on new frames x [B, T, D] after a cached prefix: `tail1` / `tail2` [B, K-1, D] are
        the last K-1 input frames of conv1 / conv2 before x (zeros at stream start = the left zero padding).
        Returns (out [B, T, D], in1, in2): in1/in2 [B, K-1+T, D] are the two convolutions' inputs from the tails on
        (the next tails are slices of them)."""
        in1 = torch.cat((tail1, x), dim=1)
        h = self.conv1[1](_conv1d(self.conv1[0], in1.transpose(1, 2)))  # [B, D, T]
        in2 = torch.cat((tail2, h.transpose(1, 2)), dim=1)
        h = self.conv2[1](_conv1d(self.conv2[0], in2.transpose(1, 2)))
        return h.transpose(1, 2), in1, in2


class InputEmbedding(nn.Module):
    """proj(concat[x, cond, mu, spks]) plus the causal conv position embedding (residual)."""

    def __init__(self, mel_dim: int, mu_dim: int, spk_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Linear(mel_dim * 2 + mu_dim + spk_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim)

    def forward(self, x, cond, mu, spks):  # [B, T, *] and spks [B, S]
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        x = self.proj(torch.cat((x, cond, mu, spks), dim=-1))
        return self.conv_pos_embed(x) + x

    def forward_cached(self, x, cond, mu, spks, tail1, tail2):
        """New frames after a cached prefix (see CausalConvPositionEmbedding.forward_cached): (h, in1, in2)."""
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        x = self.proj(torch.cat((x, cond, mu, spks), dim=-1))
        pos, in1, in2 = self.conv_pos_embed.forward_cached(x, tail1, tail2)
        return pos + x, in1, in2


class RotaryEmbedding(nn.Module):
    """x_transformers RotaryEmbedding(dim_head): interleaved pairs, theta 10000, no xpos.

    `inv_freq` is a persistent buffer (it is in the released checkpoint). It stays float32 when the module is cast to
    fp16/bf16: positions reach ~3000, and half-precision frequencies would shift the angles by about a radian.
    """

    def __init__(self, dim_head: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv_freq)

    def _apply(self, fn, recurse=True):
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables [T, dim_head] (float32), each frequency repeated for its channel pair."""
        pos = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = pos.unsqueeze(1) * self.inv_freq.to(device).unsqueeze(0)  # [T, dim_head/2]
        freqs = freqs.repeat_interleave(2, dim=-1)
        return freqs.cos(), freqs.sin()

    def at(self, offsets: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables [B, T, dim_head] for frames offsets[b] + 0..T-1 (float32; integer positions are exact in
        float32, so the tables equal `forward`'s rows at those positions bit for bit)."""
        pos = offsets.to(torch.float32).unsqueeze(1) + torch.arange(seq_len, device=offsets.device,
                                                                     dtype=torch.float32)
        freqs = pos.unsqueeze(-1) * self.inv_freq.to(offsets.device)  # [B, T, dim_head/2]
        freqs = freqs.repeat_interleave(2, dim=-1)
        return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of x [B, T, D] in interleaved pairs; the rest pass through.

    The DiT applies this before the head split, so only head 0's channels rotate (F5-TTS behaviour)."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim].float(), x[..., rot_dim:]
    pairs = x_rot.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    x_rot = x_rot * cos + rotated_half * sin
    return torch.cat((x_rot.to(x.dtype), x_pass), dim=-1)


# -------------------------------------------------------------------------------------------------------------- blocks

class AdaLayerNormZero(nn.Module):
    """SiLU -> Linear(dim, 6 dim): shift/scale/gate for attention and for the MLP; LN without affine, eps 1e-6."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(F.silu(emb)).chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroFinal(nn.Module):
    """SiLU -> Linear(dim, 2 dim) -> (scale, shift), in that order."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        scale, shift = self.linear(F.silu(emb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class FeedForward(nn.Module):
    """Linear -> GELU(tanh) -> Linear; keys `ff.0.0` and `ff.2` (index 1 is upstream's dropout)."""

    def __init__(self, dim: int, mult: int):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")), nn.Identity(),
                                nn.Linear(inner, dim))

    def forward(self, x):
        return self.ff(x)


class Attention(nn.Module):
    """Multi-head self-attention; RoPE on q/k before the head split; output zeroed at padded frames."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x, attn_mask, key_valid, rope):
        B, T, _ = x.shape
        cos, sin = rope
        q = apply_rotary(self.to_q(x), cos, sin)
        k = apply_rotary(self.to_k(x), cos, sin)
        v = self.to_v(x)
        q, k, v = (z.view(B, T, self.heads, self.dim_head).transpose(1, 2) for z in (q, k, v))
        out = _sdpa(q, k, v, attn_mask)
        out = self.to_out[0](out.transpose(1, 2).reshape(B, T, self.heads * self.dim_head))
        return out.masked_fill(~key_valid, 0.0)

    def forward_cached(self, x, attn_mask, key_valid, rope, k_all, v_all, paged=None):
        """New frames x [B, T, D] attending to a cached prefix and to themselves. k_all / v_all [B, Tp+T, D]: rows
        0..Tp-1 hold the prefix's post-RoPE keys / values (Tp = 0: no prefix); this call writes its own post-RoPE K
        and V into rows Tp.. (what a later hop reads as its prefix) and attends over the whole buffer, so the prefix
        is not copied again into a concatenation per layer and step (torch.compile writes K / V into the slice in
        place: no copy of the buffer either). `attn_mask` [B, 1, T, Tp+T]. `paged` (store K, store V, rows, plen,
        nvalid, chunk): the prefix is read in place from the page store instead (models/hop_attention.py;
        k_all / v_all then hold the new frames only, `attn_mask` is unused)."""
        B, T, _ = x.shape
        cos, sin = rope
        q = apply_rotary(self.to_q(x), cos, sin)
        Tk = k_all.shape[1]
        k_all[:, Tk - T:].copy_(apply_rotary(self.to_k(x), cos, sin))
        v_all[:, Tk - T:].copy_(self.to_v(x))
        if paged is not None:
            store_k, store_v, rows, plen, nvalid, chunk = paged
            out = hop_attention(q, k_all, v_all, store_k, store_v, rows, plen, nvalid, self.heads, chunk)
        else:
            q = q.view(B, T, self.heads, self.dim_head).transpose(1, 2)
            k, v = (z.view(B, Tk, self.heads, self.dim_head).transpose(1, 2) for z in (k_all, v_all))
            out = _sdpa(q, k, v, attn_mask).transpose(1, 2).reshape(B, T, self.heads * self.dim_head)
        out = self.to_out[0](out)
        return out.masked_fill(~key_valid, 0.0)


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int):
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, ff_mult)

    def forward(self, x, t, attn_mask, key_valid, rope):
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, t)
        x = x + gate_msa.unsqueeze(1) * self.attn(norm, attn_mask, key_valid, rope)
        norm = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)

    def forward_cached(self, x, t, attn_mask, key_valid, rope, k_all, v_all, paged=None):
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, t)
        attn = self.attn.forward_cached(norm, attn_mask, key_valid, rope, k_all, v_all, paged)
        x = x + gate_msa.unsqueeze(1) * attn
        norm = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)


# ----------------------------------------------------------------------------------------------------------------- DiT

class DiT(nn.Module):
    """The flow estimator. forward(x, mask, mu, t, spks, cond, streaming) -> velocity [B, out_channels, T]."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.cfg = cfg
        self.static_chunk_size = cfg.static_chunk_size
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg.mel_dim, cfg.mu_dim, cfg.spk_dim, cfg.dim)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(
            [DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult) for _ in range(cfg.depth)])
        self.norm_out = AdaLayerNormZeroFinal(cfg.dim)
        # upstream builds proj_out as Linear(dim, mel_dim); out_channels equals mel_dim (80) in every release
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                spks: torch.Tensor, cond: torch.Tensor, streaming: bool = False, blocks=None) -> torch.Tensor:
        """x, mu, cond [B, 80, T]; mask [B, 1, T] (1 = valid frame); t [B] (or scalar); spks [B, 80]. `blocks`:
        callables run in place of the transformer blocks (their compiled forms, `stages/compiled.py`)."""
        B, _, T = x.shape
        if t.ndim == 0:
            t = t.expand(B)
        attn_mask = attention_mask(mask, streaming, self.static_chunk_size)
        key_valid = mask.bool().transpose(1, 2)  # [B, T, 1]
        rope = self.rotary_embed(T, x.device)

        temb = self.time_embed(t.to(x.dtype))
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)
        for block in self.transformer_blocks if blocks is None else blocks:
            h = block(h, temb, attn_mask, key_valid, rope)
        h = self.norm_out(h, temb)
        return self.proj_out(h).transpose(1, 2)

    def forward_cached(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor,
                       spks: torch.Tensor, cond: torch.Tensor, offsets: torch.Tensor,
                       k_all: torch.Tensor, v_all: torch.Tensor, prefix_valid, tail1: torch.Tensor,
                       tail2: torch.Tensor, paged=None, blocks=None):
        """Streaming forward of new frames only, after a cached prefix (the flow prefix cache, stages/flow_cache).

        x, mu, cond [B, 80, T] and mask [B, 1, T] hold each row's new frames (right-padded); row b's first new frame
        is absolute frame offsets[b], a multiple of the chunk size, so every cached frame lies in a chunk to its
        left (all visible) and the block-causal mask among the new frames is the usual one. k_all / v_all
        [depth, B, Tp+T, D], or a sequence of depth [B, Tp+T, D] tensors (what the cached-hop calls pass: under
        torch.compile a slice write into one [depth, ...] input copies the whole input per layer, separate inputs are
        written in place): rows 0..Tp-1 of each hold the post-RoPE keys and values of the cached frames
        (right-padded; Tp = 0: no prefix) with prefix_valid [B, Tp] (None when Tp = 0); this call writes its own
        K/V into rows Tp.. (in place: what the caller stores as the next prefix). tail1 / tail2 [B, K-1, D] the conv
        position embedding's input tails. Returns (velocity [B, 80, T], in1, in2) with in1 / in2 [B, K-1+T, D] the
        convolutions' inputs (next tails). Equals `forward(..., streaming=True)` over prefix + new frames on the new
        frames (up to the reduction order of the shorter attention / GEMMs). `paged` (store K layers, store V layers,
        rows [B, P], plen [B]): the prefix is read in place from the flow prefix store (models/hop_attention.py):
        layer i's cached K / V at store_k[i][rows[b, p]] for p < plen[b]; k_all / v_all then hold the new frames only
        (Tp = 0) and prefix_valid is None. `blocks`: objects whose `forward_cached` runs in place of each transformer
        block's (their compiled forms)."""
        B, _, T = x.shape
        if t.ndim == 0:
            t = t.expand(B)
        valid = mask.bool()  # [B, 1, T]
        nvalid = None
        if paged is not None:  # the attention op masks by lengths (models/hop_attention.py)
            store_k, store_v, prows, plen = paged
            nvalid = valid.sum(dim=(1, 2)).long()
            attn_mask = None
        elif prefix_valid is not None:
            attn_mask = prefix_mask(prefix_valid, valid[:, 0], self.static_chunk_size)  # [B, 1, T, Tp + T]
        else:
            attn_mask = attention_mask(mask, True, self.static_chunk_size)  # [B, 1, T, T]
        key_valid = valid.transpose(1, 2)  # [B, T, 1]
        rope = self.rotary_embed.at(offsets, T)
        temb = self.time_embed(t.to(x.dtype))
        h, in1, in2 = self.input_embed.forward_cached(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2),
                                                      spks, tail1, tail2)
        for i, block in enumerate(self.transformer_blocks if blocks is None else blocks):
            lp = None if paged is None else (store_k[i], store_v[i], prows, plen, nvalid, self.static_chunk_size)
            h = block.forward_cached(h, temb, attn_mask, key_valid, rope, k_all[i], v_all[i], lp)
        h = self.norm_out(h, temb)
        return self.proj_out(h).transpose(1, 2), in1, in2


class FixedModeDiT(nn.Module):
    """A DiT with the attention mode fixed (streaming or offline): the 6-input module that gets exported."""

    def __init__(self, dit: DiT, streaming: bool):
        super().__init__()
        self.dit = dit
        self.streaming = streaming

    def forward(self, x, mask, mu, t, spks, cond):
        return self.dit(x, mask, mu, t, spks, cond, streaming=self.streaming)
