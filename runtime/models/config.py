"""Model configs as plain dataclasses: the full-size CosyVoice3 (Fun-CosyVoice3-0.5B-2512) and the tiny one.

`full_config()` and `tiny_config()` are the two presets; `config_from_golden_json()` reads a golden directory's
`config.json`; `config_from_model_dir()` reads a real model directory's `cosyvoice3.yaml` (numbers only, never its
constructors) and `CosyVoice-BlankEN/config.json`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from ...engines.errors import ConfigError
from ...engines.signatures import SAMPLES_PER_MEL_FRAME

# Speech-token layout of CosyVoice3LM: 6561 FSQ ids, then 200 specials.
SPEECH_TOKEN_SIZE = 6561
SOS = 6561
EOS = 6562
TASK_ID = 6563
FILL = 6564
NUM_SPECIAL = 200
SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)
ENDOFPROMPT_TEXT_ID = 151646


@dataclass(frozen=True)
class QwenConfig:
    hidden_size: int = 896
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class LLMConfig:
    qwen: QwenConfig = field(default_factory=QwenConfig)
    speech_token_size: int = SPEECH_TOKEN_SIZE
    # RAS sampling defaults (upstream cosyvoice3.yaml)
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    @property
    def speech_vocab(self) -> int:
        """Rows of speech_embedding / llm_decoder: 6561 + 200 specials."""
        return self.speech_token_size + NUM_SPECIAL

    @property
    def sos(self) -> int:
        return self.speech_token_size

    @property
    def eos(self) -> int:
        return self.speech_token_size + 1

    @property
    def task_id(self) -> int:
        return self.speech_token_size + 2

    @property
    def fill_token(self) -> int:
        return self.speech_token_size + 3


@dataclass(frozen=True)
class DiTConfig:
    dim: int = 1024
    depth: int = 22
    heads: int = 16
    dim_head: int = 64
    ff_mult: int = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50


@dataclass(frozen=True)
class FlowConfig:
    input_size: int = 80
    output_size: int = 80
    spk_embed_dim: int = 192
    vocab_size: int = SPEECH_TOKEN_SIZE
    token_mel_ratio: int = 2
    pre_lookahead_len: int = 3
    pre_channels: int = 1024
    dit: DiTConfig = field(default_factory=DiTConfig)
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    # Length of the fixed CFM noise buffer in mel frames: prompt + output mel must fit (15000 = 300 s upstream).
    max_mel_frames: int = 15000


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    conv_pre_look_right: int = 4
    f0_cond_channels: int = 512
    f0_look_right: int = 3
    # Length of the fixed sine-source noise buffers in mel frames (x 480 samples).
    max_mel_frames: int = 15000

    @property
    def samples_per_frame(self) -> int:
        n = self.hop_len
        for r in self.upsample_rates:
            n *= r
        return n


@dataclass(frozen=True)
class CosyVoice3Config:
    llm: LLMConfig = field(default_factory=LLMConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    hift: HiFTConfig = field(default_factory=HiFTConfig)
    sample_rate: int = 24000
    token_frame_rate: int = 25
    name: str = "full"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "CosyVoice3Config":
        def tup(x):
            return tuple(tup(v) for v in x) if isinstance(x, (list, tuple)) else x

        llm = dict(d["llm"])
        llm["qwen"] = QwenConfig(**llm["qwen"])
        flow = dict(d["flow"])
        flow["dit"] = DiTConfig(**flow["dit"])
        hift = {k: tup(v) for k, v in d["hift"].items()}
        return CosyVoice3Config(llm=LLMConfig(**llm), flow=FlowConfig(**flow), hift=HiFTConfig(**hift),
                                sample_rate=d["sample_rate"], token_frame_rate=d["token_frame_rate"],
                                name=d.get("name", "custom"))


def full_config() -> CosyVoice3Config:
    """The released Fun-CosyVoice3-0.5B-2512 architecture."""
    return CosyVoice3Config(name="full")


def tiny_config() -> CosyVoice3Config:
    """The tiny architecture of the golden vectors (same structure, small widths)."""
    return _from_sizes({
        "qwen": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
                 "max_position_embeddings": 4096, "tie_word_embeddings": True},
        "speech_token_size": 6561,
        "dit": {"dim": 128, "depth": 2, "heads": 4, "dim_head": 32, "ff_mult": 2},
        "pre_channels": 128, "hift_base": 64, "f0_cond": 64,
    }, name="tiny", max_mel_frames=3000)


def _require(d: dict, key: str, where: str, types=(int, float)):
    if key not in d:
        raise ConfigError(f"{where}: missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ConfigError(f"{where}: field {key!r} must be a number, got {v!r}")
    if not isinstance(v, types):
        raise ConfigError(f"{where}: field {key!r} has unsupported value {v!r}")
    return v


def _from_sizes(s: dict, name: str, max_mel_frames: int = 15000, where: str = "config") -> CosyVoice3Config:
    """Build a config from the compact size dict used by the golden `config.json`."""
    q = s.get("qwen")
    if not isinstance(q, dict):
        raise ConfigError(f"{where}: missing field 'qwen'")
    qkeys = [f.name for f in dataclasses.fields(QwenConfig)]
    unknown = set(q) - set(qkeys)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) in 'qwen': {sorted(unknown)}")
    qwen = QwenConfig(**{k: q[k] for k in qkeys if k in q})
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "vocab_size"):
        _require(q, k, f"{where}: qwen", int)
    if qwen.hidden_size % qwen.num_attention_heads or qwen.num_attention_heads % qwen.num_key_value_heads:
        raise ConfigError(f"{where}: qwen heads {qwen.num_attention_heads}/{qwen.num_key_value_heads} do not divide "
                          f"hidden_size {qwen.hidden_size}")
    dit = s.get("dit")
    if not isinstance(dit, dict):
        raise ConfigError(f"{where}: missing field 'dit'")
    dkeys = {f.name for f in dataclasses.fields(DiTConfig)}
    unknown = set(dit) - dkeys
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) in 'dit': {sorted(unknown)}")
    stok = _require(s, "speech_token_size", where, int)
    if stok != SPEECH_TOKEN_SIZE:
        raise ConfigError(f"{where}: speech_token_size {stok} unsupported (CosyVoice3 uses {SPEECH_TOKEN_SIZE})")
    return CosyVoice3Config(
        llm=LLMConfig(qwen=qwen, speech_token_size=stok),
        flow=FlowConfig(pre_channels=_require(s, "pre_channels", where, int), dit=DiTConfig(**dit),
                        max_mel_frames=max_mel_frames),
        hift=HiFTConfig(base_channels=_require(s, "hift_base", where, int),
                        f0_cond_channels=_require(s, "f0_cond", where, int), max_mel_frames=max_mel_frames),
        name=name)


def config_from_golden_json(path: str, max_mel_frames: int = 3000) -> CosyVoice3Config:
    """Read a golden directory's `config.json` (the tiny sizes, or any seed/size of that layout)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if "config" not in d:
        raise ConfigError(f"{path}: missing field 'config'")
    return _from_sizes(d["config"], name="golden", max_mel_frames=max_mel_frames, where=path)


# ---------------------------------------------------------------- cosyvoice3.yaml (hyperpyyaml) without executing it

class _TaggedNode(dict):
    """A hyperpyyaml `!new:` / `!name:` node kept as plain data: its class path and its arguments."""


class _InertLoader(yaml.SafeLoader):
    """SafeLoader that turns every `!tag` into data instead of constructing anything."""


def _construct_tagged(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node):
    if isinstance(node, yaml.MappingNode):
        out = _TaggedNode(loader.construct_mapping(node, deep=True))
    elif isinstance(node, yaml.SequenceNode):
        out = _TaggedNode(args=loader.construct_sequence(node, deep=True))
    else:
        out = _TaggedNode(value=loader.construct_scalar(node))
    out["__tag__"] = "!" + tag_suffix
    return out


_InertLoader.add_multi_constructor("!", _construct_tagged)


def _resolve_ref(v, top: dict, where: str):
    """Resolve `!ref <name>` and `!ref <a> * <b>` against top-level scalars."""
    if isinstance(v, _TaggedNode) and v.get("__tag__") == "!ref":
        expr = str(v.get("value", "")).strip()
        parts = [p.strip() for p in expr.split("*")]
        vals = []
        for p in parts:
            if not (p.startswith("<") and p.endswith(">")):
                raise ConfigError(f"{where}: unsupported !ref expression {expr!r}")
            name = p[1:-1]
            if name not in top:
                raise ConfigError(f"{where}: !ref to unknown field {name!r}")
            vals.append(_resolve_ref(top[name], top, where))
        if len(vals) == 1:
            return vals[0]
        prod = 1
        for x in vals:
            prod *= x
        return prod
    return v


def _field(node: dict, key: str, top: dict, where: str, types=(int, float)):
    if not isinstance(node, dict) or key not in node:
        raise ConfigError(f"{where}: missing field {key!r}")
    v = _resolve_ref(node[key], top, f"{where}.{key}")
    if isinstance(v, str):
        try:
            v = float(v) if any(c in v for c in ".eE") else int(v)
        except ValueError:
            raise ConfigError(f"{where}.{key}: expected a number, got {v!r}") from None
    if isinstance(v, list):
        v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
    if types is not None and not isinstance(v, types):
        raise ConfigError(f"{where}.{key}: unsupported value {v!r}")
    return v


def _expect(v, expected, where: str):
    if v != expected:
        raise ConfigError(f"{where}: value {v!r} is not supported by cosytrt (expected {expected!r})")


def config_from_model_dir(model_dir: str) -> CosyVoice3Config:
    """Read a real model directory: `cosyvoice3.yaml` (numbers only) + `CosyVoice-BlankEN/config.json`."""
    ypath = os.path.join(model_dir, "cosyvoice3.yaml")
    if not os.path.isfile(ypath):
        raise ConfigError(f"model directory {model_dir!r} lacks cosyvoice3.yaml")
    try:
        with open(ypath) as f:
            top = yaml.load(f, Loader=_InertLoader)  # noqa: S506 - inert loader constructs nothing
    except yaml.YAMLError as e:
        raise ConfigError(f"{ypath}: not valid YAML ({e})") from None
    if not isinstance(top, dict):
        raise ConfigError(f"{ypath}: top level must be a mapping")
    w = ypath
    sr = _field(top, "sample_rate", top, w, int)
    _expect(sr, 24000, f"{w}: sample_rate")
    llm = top.get("llm")
    flow = top.get("flow")
    hift = top.get("hift")
    for k, v in (("llm", llm), ("flow", flow), ("hift", hift)):
        if not isinstance(v, dict):
            raise ConfigError(f"{w}: missing section {k!r}")
    _expect(llm.get("__tag__"), "!new:cosyvoice.llm.llm.CosyVoice3LM", f"{w}: llm class")
    stok = _field(llm, "speech_token_size", top, f"{w}: llm", int)
    _expect(stok, SPEECH_TOKEN_SIZE, f"{w}: llm.speech_token_size")
    samp = llm.get("sampling", {})
    top_p = _field(samp, "top_p", top, f"{w}: llm.sampling") if "top_p" in samp else 0.8
    top_k = _field(samp, "top_k", top, f"{w}: llm.sampling", int) if "top_k" in samp else 25
    win = _field(samp, "win_size", top, f"{w}: llm.sampling", int) if "win_size" in samp else 10
    tau = _field(samp, "tau_r", top, f"{w}: llm.sampling") if "tau_r" in samp else 0.1

    _expect(flow.get("__tag__"), "!new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT", f"{w}: flow class")
    for k, e in (("input_size", 80), ("output_size", 80), ("vocab_size", 6561), ("token_mel_ratio", 2)):
        _expect(_field(flow, k, top, f"{w}: flow", int), e, f"{w}: flow.{k}")
    spk = _field(flow, "spk_embed_dim", top, f"{w}: flow", int)
    la = _field(flow, "pre_lookahead_len", top, f"{w}: flow", int)
    pre = flow.get("pre_lookahead_layer", {})
    pre_ch = _field(pre, "channels", top, f"{w}: flow.pre_lookahead_layer", int)
    dec = flow.get("decoder", {})
    cfm = dec.get("cfm_params", {})
    cfm = cfm.get("content", cfm) if isinstance(cfm, dict) else {}
    cfg_rate = _field(cfm, "inference_cfg_rate", top, f"{w}: flow.decoder.cfm_params") if "inference_cfg_rate" in cfm else 0.7
    if "solver" in cfm:
        _expect(cfm["solver"], "euler", f"{w}: flow.decoder.cfm_params.solver")
    if "t_scheduler" in cfm:
        _expect(cfm["t_scheduler"], "cosine", f"{w}: flow.decoder.cfm_params.t_scheduler")
    est = dec.get("estimator", {})
    _expect(est.get("__tag__"), "!new:cosyvoice.flow.DiT.dit.DiT", f"{w}: flow.decoder.estimator class")
    dit = DiTConfig(**{k: _field(est, k, top, f"{w}: flow.decoder.estimator", int) for k in
                       ("dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim", "spk_dim",
                        "out_channels", "static_chunk_size")})
    left = _field(est, "num_decoding_left_chunks", top, f"{w}: flow.decoder.estimator", int)
    _expect(left, -1, f"{w}: flow.decoder.estimator.num_decoding_left_chunks")

    _expect(hift.get("__tag__"), "!new:cosyvoice.hifigan.generator.CausalHiFTGenerator", f"{w}: hift class")
    hw = f"{w}: hift"
    istft = hift.get("istft_params", {})
    f0p = hift.get("f0_predictor", {})
    h = HiFTConfig(
        in_channels=_field(hift, "in_channels", top, hw, int),
        base_channels=_field(hift, "base_channels", top, hw, int),
        nb_harmonics=_field(hift, "nb_harmonics", top, hw, int),
        sampling_rate=_field(hift, "sampling_rate", top, hw, int),
        nsf_alpha=float(_field(hift, "nsf_alpha", top, hw)),
        nsf_sigma=float(_field(hift, "nsf_sigma", top, hw)),
        nsf_voiced_threshold=float(_field(hift, "nsf_voiced_threshold", top, hw)),
        upsample_rates=_field(hift, "upsample_rates", top, hw, tuple),
        upsample_kernel_sizes=_field(hift, "upsample_kernel_sizes", top, hw, tuple),
        n_fft=_field(istft, "n_fft", top, f"{hw}.istft_params", int),
        hop_len=_field(istft, "hop_len", top, f"{hw}.istft_params", int),
        resblock_kernel_sizes=_field(hift, "resblock_kernel_sizes", top, hw, tuple),
        resblock_dilation_sizes=_field(hift, "resblock_dilation_sizes", top, hw, tuple),
        source_resblock_kernel_sizes=_field(hift, "source_resblock_kernel_sizes", top, hw, tuple),
        source_resblock_dilation_sizes=_field(hift, "source_resblock_dilation_sizes", top, hw, tuple),
        lrelu_slope=float(_field(hift, "lrelu_slope", top, hw)),
        audio_limit=float(_field(hift, "audio_limit", top, hw)),
        conv_pre_look_right=_field(hift, "conv_pre_look_right", top, hw, int),
        f0_cond_channels=_field(f0p, "cond_channels", top, f"{hw}.f0_predictor", int),
    )
    if h.samples_per_frame != SAMPLES_PER_MEL_FRAME:
        raise ConfigError(f"{hw}: upsample_rates x hop_len = {h.samples_per_frame}, expected {SAMPLES_PER_MEL_FRAME}")

    qpath = os.path.join(model_dir, "CosyVoice-BlankEN", "config.json")
    if not os.path.isfile(qpath):
        raise ConfigError(f"model directory {model_dir!r} lacks CosyVoice-BlankEN/config.json")
    with open(qpath) as f:
        qd = json.load(f)
    qkeys = [f.name for f in dataclasses.fields(QwenConfig)]
    missing = [k for k in qkeys[:6] if k not in qd]
    if missing:
        raise ConfigError(f"{qpath}: missing field(s) {missing}")
    qwen = QwenConfig(**{k: qd[k] for k in qkeys if k in qd})
    llm_in = _field(llm, "llm_input_size", top, f"{w}: llm", int)
    if llm_in != qwen.hidden_size:
        raise ConfigError(f"{w}: llm.llm_input_size {llm_in} != Qwen2 hidden_size {qwen.hidden_size}")
    return CosyVoice3Config(
        llm=LLMConfig(qwen=qwen, speech_token_size=stok, top_p=float(top_p), top_k=int(top_k), win_size=int(win),
                      tau_r=float(tau)),
        flow=FlowConfig(spk_embed_dim=spk, pre_lookahead_len=la, pre_channels=pre_ch, dit=dit,
                        inference_cfg_rate=float(cfg_rate)),
        hift=h, sample_rate=sr, token_frame_rate=_field(top, "token_frame_rate", top, w, int), name="model_dir")
