"""The scheduler with its DiT / HiFT streams in an SM partition (`dit_green_reserve_sms`) on a GPU: the tiny model,
streaming requests with the prefix cache on, run with the partition off and on (reserves 8, 32) — each request's
audio against the run without it (max abs difference: 0 unless a library picks other kernels for fewer SMs; the
golden wav tolerance is 2e-3), the scheduler's `sm_partition` stats, and any error (~30 s, no compile).

  usage (GPU machine, after device_setup.sh --install): python3 benchmarks/green_tts_check.py [OUT.md]"""
import sys

import numpy as np
import torch

from cosytrt.runtime.scheduling.config import SchedulerConfig
from cosytrt.runtime.tts import TTS, make_request
from cosytrt.tools.table import emit

TEXT = "Hello from the green context check."


def run(reserve: int):
    cfg = SchedulerConfig(dit_green_reserve_sms=reserve, flow_prefix_cache=True)
    with TTS.load("tiny", device="cuda", scheduler=cfg) as tts:
        handles = [tts.submit(make_request(TEXT, seed=i, stream=True, force_tokens=60 + 40 * i)) for i in range(4)]
        wavs = [np.concatenate(list(h.chunks(timeout=120))) for h in handles]
        return wavs, tts.scheduler.stats().get("sm_partition")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not torch.cuda.is_available():
        print("no GPU: nothing to check")
        return 0
    ref, _ = run(0)
    lines = [f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", "",
             "| reserve SMs | sm_partition | max abs wav diff vs no partition, per request | same lengths |",
             "|---|---|---|---|"]
    for reserve in (8, 32):
        try:
            wavs, part = run(reserve)
            diffs = [float(np.abs(a - b).max()) if a.shape == b.shape else float("nan") for a, b in zip(wavs, ref)]
            lines.append(f"| {reserve} | {part} | {', '.join(f'{d:.2e}' for d in diffs)} | "
                         f"{all(a.shape == b.shape for a, b in zip(wavs, ref))} |")
        except Exception as e:  # noqa: BLE001 - the answer
            lines.append(f"| {reserve} | failed: {type(e).__name__}: {e} | | |"[:500])
        print(lines[-1], flush=True)
    emit("\n".join(lines), argv[0] if argv else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
