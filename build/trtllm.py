"""TensorRT-LLM (<= 1.2, the TensorRT-engine backend) build of the merged-vocab HF export.

Two steps, as NVIDIA's CosyVoice3 recipe (FunAudioLLM/CosyVoice `runtime/triton_trtllm/run_cosyvoice3.sh`):
1. HF -> TRT-LLM checkpoint: `tensorrt_llm.models.QWenForCausalLM.from_hugging_face(hf_dir, dtype).save_checkpoint(..)`
   (what the qwen example's `convert_checkpoint.py` calls), run as `python -c`;
2. `trtllm-build --checkpoint_dir .. --output_dir .. --max_batch_size .. --max_num_tokens .. --max_input_len ..
   --max_seq_len .. --gemm_plugin <dtype>`.
TensorRT-LLM after 1.2 removed the engine backend (convert_checkpoint / trtllm-build), hence the version check.

`runner_flags` (default on) adds what cosytrt's TensorRT-LLM AR runner (runtime/stages/ar_trtllm.py) needs: the
generation logits returned to the caller (`--gather_generation_logits`: the scheduler samples with RAS itself) and
paged context FMHA (`--use_paged_context_fmha enable`: KV-cache block reuse between its one-token requests) with small
KV blocks (`--tokens_per_block 16`: a step recomputes fewer than 16 tokens past the reused blocks).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

from cosytrt.engines.errors import BackendUnavailableError, EngineSetError, InputError, ModelDirError

DTYPES = ("float16", "bfloat16", "float32")
MAX_ENGINE_VERSION = (1, 2)

# Defaults sized for CosyVoice3: prompt = sos + text (prompt text + target, frontend splits at <= 80 tokens)
# + task_id + prompt speech (<= 30 s x 25 Hz = 750); output <= 20 x target text tokens.
DEFAULT_MAX_INPUT_LEN = 2048
DEFAULT_MAX_SEQ_LEN = 4096


def _positive(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InputError(f"trtllm: {name} must be a positive int, got {v!r}")
    return v


def convert_script(hf_dir: str, ckpt_dir: str, dtype: str) -> str:
    """The Python source run by the conversion step."""
    return ("from tensorrt_llm.models import QWenForCausalLM; "
            f"m = QWenForCausalLM.from_hugging_face({hf_dir!r}, dtype={dtype!r}); "
            f"m.save_checkpoint({ckpt_dir!r}, save_config=True)")


def trtllm_commands(hf_dir: str, ckpt_dir: str, engine_dir: str, dtype: str = "bfloat16", max_batch_size: int = 64,
                    max_num_tokens: int = 32768, max_input_len: int = DEFAULT_MAX_INPUT_LEN,
                    max_seq_len: int = DEFAULT_MAX_SEQ_LEN, gemm_plugin: str | None = None,
                    python: str | None = None, runner_flags: bool = True,
                    tokens_per_block: int = 16) -> list[list[str]]:
    """The two command lines (HF -> TRT-LLM checkpoint, then trtllm-build) as argv lists."""
    if dtype not in DTYPES:
        raise InputError(f"trtllm: dtype {dtype!r} unsupported (one of {', '.join(DTYPES)})")
    for name, v in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens),
                    ("max_input_len", max_input_len), ("max_seq_len", max_seq_len)):
        _positive(name, v)
    if max_input_len >= max_seq_len:
        raise InputError(f"trtllm: max_input_len {max_input_len} must be < max_seq_len {max_seq_len}")
    gemm = dtype if gemm_plugin is None else gemm_plugin
    convert = [python or sys.executable, "-c", convert_script(str(hf_dir), str(ckpt_dir), dtype)]
    build = ["trtllm-build",
             "--checkpoint_dir", str(ckpt_dir),
             "--output_dir", str(engine_dir),
             "--max_batch_size", str(max_batch_size),
             "--max_num_tokens", str(max_num_tokens),
             "--max_input_len", str(max_input_len),
             "--max_seq_len", str(max_seq_len),
             "--gemm_plugin", gemm]
    if runner_flags:
        _positive("tokens_per_block", tokens_per_block)
        build += ["--gather_generation_logits", "--use_paged_context_fmha", "enable",
                  "--tokens_per_block", str(tokens_per_block)]
    return [convert, build]


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def require_trtllm() -> str:
    """The installed tensorrt_llm version; BackendUnavailableError if missing or without the engine backend."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise BackendUnavailableError("trtllm", "tensorrt_llm")
    try:
        from importlib.metadata import version
        ver = version("tensorrt_llm")
    except Exception:  # noqa: BLE001 - fall back to importing it
        import tensorrt_llm
        ver = getattr(tensorrt_llm, "__version__", "0")
    if _version_tuple(ver) > MAX_ENGINE_VERSION:
        raise BackendUnavailableError("trtllm", "tensorrt_llm",
                                      f"version {ver} has no TensorRT-engine backend; install tensorrt-llm<=1.2.1")
    return ver


def build_trtllm_engine(hf_dir: str, ckpt_dir: str, engine_dir: str, **kwargs) -> str:
    """Run `trtllm_commands(...)`; returns `engine_dir`. Needs tensorrt_llm <= 1.2 (BackendUnavailableError)."""
    cmds = trtllm_commands(hf_dir, ckpt_dir, engine_dir, **kwargs)
    require_trtllm()
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ModelDirError(f"trtllm: {hf_dir} lacks config.json (run export_merged_hf first)")
    if shutil.which(cmds[1][0]) is None:
        raise BackendUnavailableError("trtllm", "tensorrt_llm", "the trtllm-build command is not on PATH")
    for cmd in cmds:
        rc = subprocess.run(cmd).returncode
        if rc != 0:
            raise EngineSetError(f"trtllm: command failed with exit status {rc}: {' '.join(cmd[:2])} ...")
    return engine_dir
