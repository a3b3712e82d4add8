"""CosyVoice3 speech-token LM: a compact Qwen2 decoder with a static, slot-indexed KV cache (gpt-fast style).

Module names reproduce the released `llm.pt` layout (`llm.model.model.layers.N...`, `llm_decoder`,
`speech_embedding`), so `state_dict()` keys are the checkpoint keys. The tied `llm.model.lm_head.weight` is
accepted and ignored on load.

Cached inference works on "slots": `setup_cache(slots, max_len)` preallocates per-layer K/V buffers
[slots, kv_heads, max_len, head_dim] once; `prefill` writes rows of different lengths into their slots and
`decode` appends one token per row. Both build their masks with tensor ops and never read tensor values on the
host, so a runner can capture them in CUDA graphs (one per batch bucket).
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .checkpoint import read_state_dict, validate_state_dict
from .config import LLMConfig, QwenConfig
from ...engines.cuda_graphs import upload
from ...engines.errors import InputError
from . import batch_invariant as _bi
from . import decode_attention_triton as _split_kv
from .rope import apply_rope, rope_cos_sin
from .versions import tensor_version

TIED_LM_HEAD_KEY = "llm.model.lm_head.weight"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class KVCache(nn.Module):
    """Preallocated K/V buffers [slots, kv_heads, max_len, head_dim] (non-persistent: not in state_dict)."""

    def __init__(self, slots: int, kv_heads: int, max_len: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        shape = (slots, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write_prefix(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [B, kv_heads, T, hd] at positions 0..T-1 of each row's slot."""
        t = k.shape[2]
        self.k[slots, :, :t] = k
        self.v[slots, :, :t] = v

    def write_one(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, kv_heads, 1, hd] at `positions` [B] of each row's slot."""
        self.k[slots, :, positions] = k[:, :, 0]
        self.v[slots, :, positions] = v[:, :, 0]


class FusedLinear(nn.Module):
    """Several linear maps of the same input as one GEMM (`parts` are concatenated along the output axis): one
    launch instead of three (q, k, v) or two (gate, up) per layer, which is what a batch-1 decode step pays for."""

    def __init__(self, parts: list[nn.Linear]):
        super().__init__()
        self.split_sizes = [p.out_features for p in parts]
        self.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]))
        self.bias = None if parts[0].bias is None else nn.Parameter(torch.cat([p.bias.detach() for p in parts]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.split_sizes, dim=-1)


def _keep_checkpoint_keys(module: nn.Module, fused: str, parts: tuple[str, ...]) -> None:
    """`module.<fused>` (a FusedLinear) reads and writes the released checkpoint's separate `<part>.weight` /
    `<part>.bias` keys: state_dict() splits it, load_state_dict() concatenates them."""

    def split(mod, state_dict, prefix, _meta):
        # this module's keys are the last ones; the fused map is its first child, so its parts go first (released
        # order: q.weight, q.bias, k.weight, ..., then o_proj)
        sizes = getattr(mod, fused).split_sizes
        mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        weights = mine.pop(f"{prefix}{fused}.weight").split(sizes)
        bias = mine.pop(f"{prefix}{fused}.bias", None)
        biases = [None] * len(parts) if bias is None else bias.split(sizes)
        for name, w, b in zip(parts, weights, biases):
            state_dict[f"{prefix}{name}.weight"] = w
            if b is not None:
                state_dict[f"{prefix}{name}.bias"] = b
        state_dict.update(mine)

    def merge(state_dict, prefix, *_args):
        for attr in ("weight", "bias"):
            keys = [f"{prefix}{name}.{attr}" for name in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{attr}"] = torch.cat([state_dict.pop(k) for k in keys])

    module.register_state_dict_post_hook(split)
    module._register_load_state_dict_pre_hook(merge)


# Under torch.compile, decode steps of at most `reduce_max_rows` rows write the attention as multiply-and-sum
# reductions: Inductor emits a few Triton reductions that read K and V straight out of the slot cache (the gather
# becomes an indirect load) instead of a gathered copy plus an attention kernel built for long queries. H200, full
# size, KV rung 1024 (BENCHMARKS.md): batch 2 1.18 ms vs 1.45 ms with SDPA, but batch 8 2.12 vs 1.52 and batch
# 32 4.98 vs 1.81 (the fused softmax re-reads K per pass), so larger batches keep SDPA. The branch is on the
# (symbolic) batch size: dynamo compiles the decode step twice (<= 2 rows, more). Eager always uses SDPA: the reduce
# form would materialize [B, kv_heads, group, n, head_dim] products.
# REDUCE_ATTENTION_MAX_ROWS is the default of `CosyVoice3LM.reduce_attention_max_rows` (per LM instance; `decode`
# takes an override per call, e.g. 0 for SDPA at every batch). It is read, never assigned, at run time.
REDUCE_ATTENTION_MAX_ROWS = 2
# The decode step's attention (`CosyVoice3LM.decode_attention_impl`): "sdpa" (the module's default: SDPA, or the
# reduce form above under compile), or "split_kv": split-KV Triton kernels at every batch (decode_attention_triton.py:
# parallel over fixed key splits, each row read up to its own length and in place from its KV slot; CUDA with Triton,
# the torch reference elsewhere). The scheduler picks split_kv on CUDA by default (SchedulerConfig.ar_decode_attention
# "auto").
DECODE_ATTENTION_IMPLS = ("sdpa", "split_kv")


class Attention(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear([nn.Linear(cfg.hidden_size, q_size, bias=True),
                                     nn.Linear(cfg.hidden_size, kv_size, bias=True),
                                     nn.Linear(cfg.hidden_size, kv_size, bias=True)])
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.kv_cache: KVCache | None = None
        self.decode_impl = "sdpa"  # one of DECODE_ATTENTION_IMPLS, set through CosyVoice3LM.decode_attention_impl
        _keep_checkpoint_keys(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def _expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, S, hd] -> [B, heads, S, hd] (query head h reads kv head h // group)."""
        b, kvh, s, hd = x.shape
        group = self.num_heads // kvh
        return x[:, :, None].expand(b, kvh, group, s, hd).reshape(b, kvh * group, s, hd)

    def forward(self, x, cos, sin, mask=None, slots=None, positions=None, kv_len=None, rows_are_slots=False,
                reduce_max_rows=REDUCE_ATTENTION_MAX_ROWS):
        """x [B, T, H]. No `slots`: plain causal attention. `slots` only: prefill (write 0..T-1, attend to the
        fresh K/V under `mask`). `slots` + `positions`: decode one token (T == 1), attend to the slot cache
        (`rows_are_slots`: slots are 0..B-1, so the cache is read as a view instead of gathered;
        `reduce_max_rows`: see `decode_attention`)."""
        b, t, _ = x.shape
        q, k, v = self.qkv_proj(x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if slots is not None:
            if positions is None:
                self.kv_cache.write_prefix(slots, k, v)
            else:
                self.kv_cache.write_one(slots, positions, k, v)
                n = self.kv_cache.max_len if kv_len is None else kv_len
                group = self.num_heads // self.num_kv_heads
                if self.decode_impl == "split_kv" and not rows_are_slots:
                    # the split-KV kernels read each row's K / V in place from its slot (no gathered copy)
                    out = _split_kv.split_kv_decode_attention_slots(
                        q.reshape(b, self.num_kv_heads, group, self.head_dim), self.kv_cache.k, self.kv_cache.v,
                        slots, positions, n)
                    return self.o_proj(out.reshape(b, 1, self.num_heads * self.head_dim))
                if rows_are_slots:
                    k, v = self.kv_cache.k[:b, :, :n], self.kv_cache.v[:b, :, :n]
                else:
                    k, v = self.kv_cache.k[slots, :, :n], self.kv_cache.v[slots, :, :n]
                # One query per row: fold each kv head's query group into the query axis instead of
                # repeating K/V per query head (same result, no [B, heads, n, hd] copies).
                out = decode_attention(q.reshape(b, self.num_kv_heads, group, self.head_dim), k, v, mask,
                                       reduce_max_rows, positions if self.decode_impl == "split_kv" else None)
                return self.o_proj(out.reshape(b, 1, self.num_heads * self.head_dim))
        k, v = self._expand_kv(k), self._expand_kv(v)
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


# The prefill's shapes change from call to call (rows x padded length), and batches that no prefill graph holds run
# outside CUDA graphs. cuDNN's fused attention builds an execution plan for every new shape (~400 ms on an H100,
# sglang PR #4650), which would stall the AR worker, and every request decoding in it, on each new admission shape
# (a likely cause of an admission delay seen on the first cell of 32 concurrent requests). So the
# prefill attention never uses the cuDNN backend; the decode step keeps the default choice (its shapes are the
# fixed ones of its CUDA graphs). Traced into the compiled prefill as well (one graph, no guard on global state).
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]




def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     reduce_max_rows: int = REDUCE_ATTENTION_MAX_ROWS,
                     split_kv_positions: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, kvh, G, hd] (G query heads per kv head), k / v [B, kvh, n, hd], mask [B, 1, 1, n] (True = attend).
    Under torch.compile, batches of at most `reduce_max_rows` rows take the multiply-and-sum form (see above).
    `split_kv_positions` [B] (the mask's positions: row b attends keys 0..position): the split-KV op instead."""
    if split_kv_positions is not None:
        return _split_kv.split_kv_decode_attention(q, k, v, split_kv_positions)
    if torch.compiler.is_compiling() and q.shape[0] <= reduce_max_rows:
        scores = (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)        # [B, kvh, G, n]
        return (probs[..., None] * v.float()[:, :, None]).sum(-2).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.gate_up_proj = FusedLinear([nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False),
                                         nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)])
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        _keep_checkpoint_keys(self, "gate_up_proj", ("gate_proj", "up_proj"))

    def forward(self, x):
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask=None, slots=None, positions=None, kv_len=None, rows_are_slots=False,
                reduce_max_rows=REDUCE_ATTENTION_MAX_ROWS):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, slots, positions, kv_len, rows_are_slots,
                               reduce_max_rows)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Backbone(nn.Module):
    """Token embedding, decoder layers and final RMSNorm (HF `Qwen2Model` layout)."""

    def __init__(self, cfg: QwenConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Holder(nn.Module):
    """One child named `model`: reproduces the released `llm.model.model.` key prefix."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


class CosyVoice3LM(nn.Module):
    def __init__(self, config: LLMConfig):
        super().__init__()
        self.config = config
        q = config.qwen
        self.llm = _Holder(_Holder(Qwen2Backbone(q)))
        self.llm_decoder = nn.Linear(q.hidden_size, config.speech_vocab, bias=False)
        self.speech_embedding = nn.Embedding(config.speech_vocab, q.hidden_size)
        # Batch-invariant prefill / decode (`models/batch_invariant.py`): a row's logits do not depend on the other
        # rows of the call nor on the padded bucket / KV length. Off by default here (the plain kernels are the
        # reference numerics); the scheduler sets it from `SchedulerConfig.batch_invariant`.
        self.batch_invariant = False
        # Decode steps of at most this many rows use the multiply-and-sum attention under torch.compile
        # (`decode_attention`); `decode(..., reduce_attention_max_rows=)` overrides it for one call (the micro bench
        # compiles a second decode with 0: SDPA at every batch).
        self.reduce_attention_max_rows = REDUCE_ATTENTION_MAX_ROWS

    @property
    def decode_attention_impl(self) -> str:
        """The decode step's attention kernels, one of DECODE_ATTENTION_IMPLS (set it before compiling or
        capturing decode calls; the scheduler sets it from `SchedulerConfig.ar_decode_attention`)."""
        return self.backbone.layers[0].self_attn.decode_impl if len(self.backbone.layers) else "sdpa"

    @decode_attention_impl.setter
    def decode_attention_impl(self, impl: str) -> None:
        if impl not in DECODE_ATTENTION_IMPLS:
            raise InputError(f"decode_attention_impl must be one of {', '.join(DECODE_ATTENTION_IMPLS)}, got {impl!r}")
        for layer in self.backbone.layers:
            layer.self_attn.decode_impl = impl

    # ------------------------------------------------------------------ weights

    @property
    def backbone(self) -> Qwen2Backbone:
        return self.llm.model.model

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Released `llm.pt` keys and shapes, including the tied (ignored) `llm.model.lm_head.weight`."""
        q = self.config.qwen
        out: dict[str, tuple[int, ...]] = {}
        for k, v in self.state_dict().items():
            out[k] = tuple(v.shape)
            if k == "llm.model.model.norm.weight":
                out[TIED_LM_HEAD_KEY] = (q.vocab_size, q.hidden_size)
        return out

    def load_checkpoint(self, sd: Mapping[str, torch.Tensor] | str) -> None:
        """Load a released-layout state dict (or a path to one); CheckpointError names any bad key."""
        what = "llm checkpoint"
        if isinstance(sd, str):
            what = f"llm checkpoint {sd}"
            sd = read_state_dict(sd)
        validate_state_dict(sd, self.checkpoint_shapes(), what, optional=(TIED_LM_HEAD_KEY,))
        self.load_state_dict({k: v for k, v in sd.items() if k != TIED_LM_HEAD_KEY}, strict=True)

    @property
    def dtype(self) -> torch.dtype:
        return self.llm_decoder.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.llm_decoder.weight.device

    # ------------------------------------------------------------------ inputs

    def embed_speech(self, ids: torch.Tensor) -> torch.Tensor:
        return self.speech_embedding(ids)

    def build_lm_input(self, text_ids: torch.Tensor, prompt_speech_ids: torch.Tensor | None = None, *,
                       prompt_speech_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[sos, embed_tokens(text), task_id, speech_embedding(prompt_speech)] -> [L, H].

        `text_ids` is prompt text + target text ([1, Lt] or [Lt]); `prompt_speech_ids` [Ls] or [1, Ls], may be empty.
        `prompt_speech_embeds` instead of the ids: `embed_prompt_speech(ids)` made earlier (a saved voice's, reused
        request after request: the same values, fewer operations on the frontend's thread)."""
        text_ids = _as_ids(text_ids, "text_ids")
        if text_ids.numel() == 0:
            raise InputError("build_lm_input: text_ids is empty")
        # ids are checked where they are (the tokenizer's are on the host) before they move: a check of device ids
        # reads them back, which waits for every kernel queued on the stream (under load: other requests' DiT steps)
        _check_range(text_ids, self.config.qwen.vocab_size, "build_lm_input: text id")
        if prompt_speech_embeds is None:
            prompt_speech_embeds = self.embed_prompt_speech(prompt_speech_ids)
        dev = self.device
        sos, task = self._special_embeds(dev)
        return torch.cat([sos, self.backbone.embed_tokens(upload(text_ids, dev)), task, prompt_speech_embeds], dim=0)

    def embed_prompt_speech(self, prompt_speech_ids: torch.Tensor | None) -> torch.Tensor:
        """The LM input's prompt speech part: speech_embedding(ids) [Ls, H] on the model's device (ids checked on
        the host first); [0, H] for none."""
        if prompt_speech_ids is None:
            prompt_speech_ids = torch.zeros(0, dtype=torch.long)
        speech = _as_ids(prompt_speech_ids, "prompt_speech_ids")
        _check_range(speech, self.config.speech_token_size, "build_lm_input: prompt speech token")
        return self.speech_embedding(upload(speech, self.device))

    def _special_embeds(self, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """speech_embedding of [sos] and [task_id] ([1, H] each), memoized per weight version (an in-place weight
        load makes them anew)."""
        version = tensor_version(self.speech_embedding.weight)
        memo = self.__dict__.setdefault("_cosytrt_special_embeds", {})
        hit = memo.get(str(dev))
        if hit is None or hit[0] != version:
            with torch.inference_mode(False), torch.no_grad():  # a normal tensor: usable in and out of inference
                se = self.speech_embedding(self._special_ids(dev))
            hit = memo[str(dev)] = (version, (se[:1], se[1:]))
        return hit[1]

    def _special_ids(self, dev) -> torch.Tensor:
        """[sos, task_id] on `dev`, made once (a tensor built from a list is a blocking host-to-device copy)."""
        memo = self.__dict__.setdefault("_cosytrt_special", {})
        key = str(dev)
        if key not in memo:
            with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
                memo[key] = torch.tensor([self.config.sos, self.config.task_id], device=dev)
        return memo[key]

    # ------------------------------------------------------------------ full forward (no cache)

    def forward_hidden(self, embeds: torch.Tensor) -> torch.Tensor:
        """Causal forward over embeds [B, T, H] -> last hidden state (final norm applied) [B, T, H]."""
        t = embeds.shape[1]
        positions = torch.arange(t, device=embeds.device)
        cos, sin = rope_cos_sin(positions, self.config.qwen.head_dim, self.config.qwen.rope_theta, embeds.dtype)
        x = embeds
        for layer in self.backbone.layers:
            x = layer(x, cos, sin)
        return self.backbone.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm_decoder(hidden)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.logits(self.forward_hidden(embeds))

    # ------------------------------------------------------------------ static KV cache

    def setup_cache(self, slots: int, max_len: int, device=None, dtype=None) -> None:
        """Preallocate per-layer K/V buffers [slots, kv_heads, max_len, head_dim] (replaces any previous cache)."""
        if not isinstance(slots, int) or slots < 1:
            raise InputError(f"setup_cache: slots must be a positive int, got {slots!r}")
        if not isinstance(max_len, int) or max_len < 1:
            raise InputError(f"setup_cache: max_len must be a positive int, got {max_len!r}")
        q = self.config.qwen
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        for layer in self.backbone.layers:
            layer.self_attn.kv_cache = KVCache(slots, q.num_key_value_heads, max_len, q.head_dim, device, dtype)

    @property
    def cache_shape(self) -> tuple[int, int] | None:
        """(slots, max_len) of the current cache, or None."""
        c = self.backbone.layers[0].self_attn.kv_cache
        return None if c is None else (c.k.shape[0], c.k.shape[2])

    def _require_cache(self, what: str, t: int) -> None:
        shape = self.cache_shape
        if shape is None:
            raise InputError(f"{what}: no KV cache, call setup_cache(slots, max_len) first")
        if t > shape[1]:
            raise InputError(f"{what}: {t} positions exceed the cache max_len {shape[1]}")

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor | None,
                return_hidden: bool = False, layers=None):
        """Right-padded embeds [B, T, H] with real `lengths` [B] into cache `slots` [B] (None: rows 0..B-1).

        Writes each row's K/V at positions 0..T-1 of its slot (padding positions get overwritten by decode and are
        never attended). Returns speech logits [B, V] at each row's last real position (and hidden [B, T, H]).
        `layers`: callables run in place of the decoder layers (their compiled forms, `stages/compiled.py`)."""
        b, t, _ = embeds.shape
        self._require_cache("prefill", t)
        dev = embeds.device
        if slots is None:
            slots = torch.arange(b, device=dev)
        if self.batch_invariant:
            logits, hidden = _bi.prefill(self, embeds, lengths, slots)
            return (logits, hidden) if return_hidden else logits
        positions = torch.arange(t, device=dev)
        causal = positions[None, :] <= positions[:, None]                          # [T, T]
        valid = positions[None, :] < lengths.to(dev)[:, None]                      # [B, T]
        mask = (causal[None] & valid[:, None, :])[:, None]                         # [B, 1, T, T]
        cos, sin = rope_cos_sin(positions, self.config.qwen.head_dim, self.config.qwen.rope_theta, embeds.dtype)
        x = embeds
        for layer in self.backbone.layers if layers is None else layers:
            x = layer(x, cos, sin, mask, slots=slots)
        hidden = self.backbone.norm(x)
        last = hidden[torch.arange(b, device=dev), lengths.to(dev) - 1]            # [B, H]
        logits = self.llm_decoder(last)
        return (logits, hidden) if return_hidden else logits

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor | None, positions: torch.Tensor,
               kv_len: int | None = None, return_hidden: bool = False, reduce_attention_max_rows: int | None = None,
               layers=None):
        """One token per row: `tokens` = speech ids [B] (long) or embeddings [B, H], written at `positions` [B] of
        `slots` [B]; each row attends to 0..position of its slot. `slots=None` means rows 0..B-1 (the cache is then
        read in place, no gather). `kv_len` (a static int > every position) limits the attended cache length.
        `reduce_attention_max_rows`: this call's `decode_attention` threshold (None: the instance's). `layers`: as
        in `prefill`. Returns logits [B, V] (and hidden [B, H])."""
        if not tokens.is_floating_point():
            tokens = self.speech_embedding(tokens)
        x = tokens[:, None, :]                                                     # [B, 1, H]
        self._require_cache("decode", 0 if kv_len is None else kv_len)
        n = self.cache_shape[1] if kv_len is None else kv_len
        dev = x.device
        rows_are_slots = slots is None
        if rows_are_slots:
            slots = torch.arange(x.shape[0], device=dev)
        positions = positions.to(dev)
        if self.batch_invariant:
            logits, hidden = _bi.decode(self, x[:, 0], slots, positions, n, rows_are_slots)
            return (logits, hidden) if return_hidden else logits
        reduce_rows = self.reduce_attention_max_rows if reduce_attention_max_rows is None else reduce_attention_max_rows
        mask = (torch.arange(n, device=dev)[None, :] <= positions[:, None])[:, None, None, :]  # [B, 1, 1, n]
        cos, sin = rope_cos_sin(positions[:, None], self.config.qwen.head_dim, self.config.qwen.rope_theta, x.dtype)
        cos, sin = cos[:, None], sin[:, None]                                      # [B, 1, 1, hd]
        for layer in self.backbone.layers if layers is None else layers:
            x = layer(x, cos, sin, mask, slots=slots, positions=positions, kv_len=n, rows_are_slots=rows_are_slots,
                      reduce_max_rows=reduce_rows)
        hidden = self.backbone.norm(x)[:, 0]
        logits = self.llm_decoder(hidden)
        return (logits, hidden) if return_hidden else logits


def _as_ids(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, dtype=torch.long)
    if x.is_floating_point():
        raise InputError(f"{name} must be integer token ids, got dtype {x.dtype}")
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1:
        raise InputError(f"{name} must be [L] or [1, L], got shape {tuple(x.shape)}")
    return x if x.dtype == torch.long else x.long()


def _check_range(ids: torch.Tensor, size: int, what: str) -> None:
    """InputError unless every id is in [0, size). Read as a list: one call into torch instead of four (each
    one a GIL hand-off on a busy server's frontend thread)."""
    if not ids.numel():
        return
    vals = ids.tolist()
    lo, hi = min(vals), max(vals)
    if lo < 0 or hi >= size:
        raise InputError(f"{what} out of range [0, {size}): min {lo}, max {hi}")
