"""Loading the three CosyVoice3 models: the embedded tiny default, a golden directory, or a real model directory.

`load_models("tiny")` creates the tiny, seeded, randomly initialised CosyVoice3 on first use and caches it in the user
cache directory (`$COSYTRT_CACHE`, default `~/.cache/cosytrt`), so every command works on a fresh machine.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch

from .checkpoint import read_state_dict
from .config import CosyVoice3Config, config_from_golden_json, config_from_model_dir, full_config, tiny_config
from ...engines.errors import ModelDirError
from ...engines.manifest import sha256_file

TINY_SEED = 1234
TINY_VERSION = "tiny-v1"
CHECKPOINTS = ("llm.pt", "flow.pt", "hift.pt")
REAL_MODEL_FILES = ("cosyvoice3.yaml", "llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx",
                    "CosyVoice-BlankEN")


@dataclass
class CosyVoice3Models:
    """The three eager models plus where they came from."""

    config: CosyVoice3Config
    llm: torch.nn.Module
    flow: torch.nn.Module
    hift: torch.nn.Module
    source: str  # "tiny", a golden dir or a model dir
    model_dir: str  # folder holding the checkpoints (and frontends for tiny / real models)
    weights_hash: str
    file_hashes: dict = field(default_factory=dict)  # {"llm.pt": full sha256, ..., "campplus.onnx": ...}

    @property
    def kind(self) -> str:
        if self.source == "tiny":
            return "tiny"
        return "real" if os.path.isfile(os.path.join(self.model_dir, "cosyvoice3.yaml")) else "golden"

    def to(self, device=None, dtype: torch.dtype | None = None) -> "CosyVoice3Models":
        """Move to a device; `dtype` applies to the LM and flow (HiFT stays float32, its f0 predictor float64)."""
        for m in (self.llm, self.flow):
            m.to(device=device, dtype=dtype)
        self.hift.to(device=device)
        return self


def check_device(device) -> None:
    """A CUDA device asked for where there is none gets a clear error (not a torch assertion)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from ...engines.errors import CosytrtError

        raise CosytrtError(f"device {str(device)!r} requested but this torch build has no usable CUDA GPU")


def cache_dir() -> str:
    return os.environ.get("COSYTRT_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "cosytrt"))


def build_modules(config: CosyVoice3Config, device: str | torch.device = "cpu"):
    """Instantiate the three models (random init) for a config; `device="meta"` allocates nothing."""
    from .flow import Flow
    from .hift import HiFT
    from .llm import CosyVoice3LM

    with torch.device(device):
        mods = CosyVoice3LM(config.llm).eval(), Flow(config.flow).eval(), HiFT(config.hift).eval()
    if torch.device(device).type != "meta":  # fixed-noise buffers are drawn on the CPU: move them too
        for m in mods:
            m.to(device)
    return mods


# files of a model directory whose sha256 is recorded in engine-set manifests and shown at start-up
HASHED_FILES = CHECKPOINTS + ("campplus.onnx", "speech_tokenizer_v3.onnx")


def hash_files(paths: list[str]) -> str:
    """The short weights hash of the checkpoints (names and per-file sha256s; changes when any byte does)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(os.path.basename(p).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()[:16]


def model_file_hashes(model_dir: str) -> dict[str, str]:
    """{file: sha256} of the checkpoints and ONNX frontends present in a model directory."""
    return {f: sha256_file(os.path.join(model_dir, f)) for f in HASHED_FILES
            if os.path.isfile(os.path.join(model_dir, f))}


def describe_hashes(models: "CosyVoice3Models", width: int = 16) -> str:
    """One line for start-up output: `model DIR: llm.pt sha256 1a2b.., flow.pt ..`."""
    parts = ", ".join(f"{k} {v[:width]}" for k, v in models.file_hashes.items())
    return f"model {models.model_dir} (weights {models.weights_hash}): sha256 {parts}"


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Seeded values of a sane scale for every parameter (the golden generator's scheme)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:
                base = 1.0 if ("norm" in name and "weight" in name) or name.endswith("alpha") else 0.0
                p.copy_(base + 0.02 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p[0].numel(), 1) ** 0.5)


def random_checkpoints(config: CosyVoice3Config, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """State dicts in the released layout with seeded random weights (f0 in the voiced range, moderate gain)."""
    llm, flow, hift = build_modules(config)
    for i, m in enumerate((llm, flow, hift)):
        _randomize(m, seed + i)
    with torch.no_grad():
        hift.f0_predictor.classifier.bias.fill_(180.0)
        hift.conv_post.parametrizations.weight.original0.mul_(0.1)
    return {"llm.pt": llm.state_dict(), "flow.pt": flow.state_dict(), "hift.pt": hift.state_dict()}


def ensure_tiny_dir() -> str:
    """Create (once) and return the cached tiny model directory: checkpoints, config.json and ONNX frontends."""
    final = os.path.join(cache_dir(), TINY_VERSION)
    if all(os.path.isfile(os.path.join(final, f)) for f in CHECKPOINTS + ("config.json", "campplus.onnx",
                                                                             "speech_tokenizer_v3.onnx")):
        return final
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=TINY_VERSION + ".", dir=cache_dir())
    try:
        cfg = tiny_config()
        torch.manual_seed(TINY_SEED)
        for name, sd in random_checkpoints(cfg, TINY_SEED).items():
            torch.save(sd, os.path.join(tmp, name))
        q = cfg.llm.qwen
        sizes = {"qwen": {k: getattr(q, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "intermediate_size", "vocab_size",
                                                       "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                                       "tie_word_embeddings")},
                 "speech_token_size": cfg.llm.speech_token_size,
                 "dit": {"dim": cfg.flow.dit.dim, "depth": cfg.flow.dit.depth, "heads": cfg.flow.dit.heads,
                         "dim_head": cfg.flow.dit.dim_head, "ff_mult": cfg.flow.dit.ff_mult},
                 "pre_channels": cfg.flow.pre_channels, "hift_base": cfg.hift.base_channels,
                 "f0_cond": cfg.hift.f0_cond_channels}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"seed": TINY_SEED, "config": sizes, "cosytrt": TINY_VERSION}, f, indent=1)
        from .tiny_frontends import write_tiny_frontends

        write_tiny_frontends(tmp)
        if os.path.isdir(final):  # a partial or concurrent earlier attempt
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(final):
            raise
    return final


def resolve_source(source: str) -> tuple[str, str, CosyVoice3Config]:
    """-> (kind, directory, config) for "tiny", a golden directory or a real model directory."""
    if source == "tiny":
        d = ensure_tiny_dir()
        return "tiny", d, config_from_golden_json(os.path.join(d, "config.json"), max_mel_frames=3000)
    if not os.path.isdir(source):
        raise ModelDirError(f"model directory not found: {source!r} (use 'tiny' for the embedded default)")
    if os.path.isfile(os.path.join(source, "cosyvoice3.yaml")):
        missing = [f for f in REAL_MODEL_FILES if not os.path.exists(os.path.join(source, f))]
        if missing:
            raise ModelDirError(f"model directory {source!r} lacks {', '.join(missing)}")
        return "real", source, config_from_model_dir(source)
    if os.path.isfile(os.path.join(source, "config.json")):
        missing = [f for f in CHECKPOINTS if not os.path.isfile(os.path.join(source, f))]
        if missing:
            raise ModelDirError(f"golden directory {source!r} lacks {', '.join(missing)}")
        return "golden", source, config_from_golden_json(os.path.join(source, "config.json"))
    raise ModelDirError(f"{source!r} is neither a CosyVoice3 model directory (no cosyvoice3.yaml) nor a golden "
                        f"directory (no config.json)")


def load_models(source: str = "tiny", device: str = "cpu", dtype: torch.dtype | None = None) -> CosyVoice3Models:
    """Load the LM, flow and HiFT with strict key checking; errors name the file and key."""
    check_device(device)
    kind, d, config = resolve_source(source)
    llm, flow, hift = build_modules(config)
    paths = [os.path.join(d, f) for f in CHECKPOINTS]
    for module, path in zip((llm, flow, hift), paths):
        module.load_checkpoint(read_state_dict(path))
    models = CosyVoice3Models(config=config, llm=llm, flow=flow, hift=hift, source=source if kind == "tiny" else d,
                              model_dir=d, weights_hash=hash_files(paths), file_hashes=model_file_hashes(d))
    return models.to(device=device, dtype=dtype)


__all__ = ["CosyVoice3Models", "load_models", "build_modules", "ensure_tiny_dir", "random_checkpoints",
           "resolve_source", "cache_dir", "full_config", "tiny_config"]
