"""Loading what one replica needs: a stage's models only (the others on the meta device), or the frontend alone."""
from __future__ import annotations

import os

import torch

from ...engines.dtypes import TORCH_DTYPES
from .config import StageConfig


def load_stage_models(source: str, device: str = "cpu", dtype: torch.dtype | None = None,
                      parts=("llm", "flow", "hift")):
    """`load_models`, but only `parts` get weights (on `device`); the other models are built on the meta device, so
    an AR replica holds no flow / HiFT and a token2wav replica no LM. The weights hash covers all three files, so
    engine sets built for the model still match."""
    from ..models.checkpoint import read_state_dict
    from ..models.loading import CHECKPOINTS, CosyVoice3Models, build_modules, check_device, hash_files, resolve_source

    check_device(device)
    kind, d, config = resolve_source(source)
    paths = [os.path.join(d, f) for f in CHECKPOINTS]
    mods = []
    for name, meta, path in zip(("llm", "flow", "hift"), build_modules(config, "meta"), paths):
        if name not in parts:
            mods.append(meta)
            continue
        m = type(meta)(getattr(config, name)).eval()
        m.load_checkpoint(read_state_dict(path))
        mods.append(m.to(device=device) if name == "hift" else m.to(device=device, dtype=dtype))
    return CosyVoice3Models(config=config, llm=mods[0], flow=mods[1], hift=mods[2],
                            source=source if kind == "tiny" else d, model_dir=d, weights_hash=hash_files(paths))


def load_stage_pipeline(source: str, stage: StageConfig, parts):
    from ..stages.pipeline import Pipeline

    models = load_stage_models(source, stage.device, TORCH_DTYPES.get(stage.dtype), parts)
    pipeline = Pipeline(models, frontend=None, default_speaker=None)
    real = {"llm": models.llm, "flow": models.flow, "hift": models.hift}[parts[0]]
    pipeline.device = next(real.parameters()).device
    return pipeline


def load_frontend(source: str):
    """(Frontend, built-in voice or None, sample rate) without loading any model weights."""
    from ..models.loading import CosyVoice3Models, resolve_source
    from ..stages.pipeline import make_frontend

    kind, d, config = resolve_source(source)
    models = CosyVoice3Models(config=config, llm=None, flow=None, hift=None, source=source if kind == "tiny" else d,
                              model_dir=d, weights_hash="")
    frontend, speaker = make_frontend(models)
    return frontend, speaker, int(config.sample_rate)
