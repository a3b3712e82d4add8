"""The PyTorch LM's AR runner as a SchedulerConfig describes it (`scheduler.make_ar_runner` picks the runner kind;
the AR process builds its runner here too)."""
from __future__ import annotations

import torch

from ...engines.errors import InputError
from ..models import decode_attention_triton
from ..stages.ar_runner import TorchARRunner
from .ar_worker import step_lock
from .config import SchedulerConfig


def torch_ar_runner(lm, cfg: SchedulerConfig, device, max_len: int) -> TorchARRunner:
    """KV slots, CUDA-graph ladders and compile for `lm` (its batch-invariant and decode-attention switches set from
    `cfg` first: before any compile / graph capture of its calls)."""
    lm.batch_invariant = cfg.batch_invariant
    impl = cfg.decode_attention_for(device)
    if impl == "split_kv" and torch.device(device).type == "cuda":
        if not decode_attention_triton.available():
            raise InputError("SchedulerConfig.ar_decode_attention='split_kv' needs Triton on CUDA, and it is not "
                             "installed: use 'sdpa'")
    lm.decode_attention_impl = impl
    runner = TorchARRunner(lm, cfg.ar_max_batch, max_len, device, cuda_graphs=cfg.cuda_graphs, compile=cfg.compile,
                           graph_batches=cfg.ar_graph_batches, prefill_graph_batches=cfg.ar_prefill_graph_batches,
                           prefill_graph_lengths=cfg.ar_prefill_graph_lengths,
                           max_prefill_tokens=cfg.ar_max_prefill_tokens, graph_sampling=cfg.ar_graph_sampling)
    if cfg.batch_invariant:  # the promise checked on this device and these graphs (a warning if it fails)
        runner.check_batch_invariance()
    return runner


def enable_for(runner, cfg: SchedulerConfig) -> None:
    """What a scheduler with `cfg` needs of a runner that may have been made for another (`TTS.reconfigure`, the AR
    process's sessions): its decode graphs with the sampler (`ar_graph_sampling`, once) and its multi-step decode
    graphs (`ar_decode_steps`, or none) — captured under the runner's step lock, since another scheduler's AR
    worker may be mid-step over it."""
    with step_lock(runner):
        if cfg.ar_graph_sampling and hasattr(runner, "enable_graph_sampling"):
            runner.enable_graph_sampling()
        if hasattr(runner, "enable_decode_steps"):
            runner.enable_decode_steps(cfg.ar_decode_steps)
